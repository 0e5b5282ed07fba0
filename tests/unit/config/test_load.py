import pytest

from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config, load_config, parse_overrides

BASE = {"model_name_or_path": "m", "output_dir": "o"}


def test_defaults_and_sections():
    cfg = build_config(dict(BASE))
    assert cfg.finetuning.stage == "sft" and cfg.finetuning.finetuning_type == "lora"
    assert cfg.data.dataset_dir == "data" and cfg.data.cutoff_len == 2048
    assert cfg.flat()["lora_rank"] == 8


def test_typo_suggests_closest_field():
    with pytest.raises(ConfigError, match=r"lerning_rate: unknown field \(did you mean 'learning_rate'\?\)"):
        build_config({**BASE, "lerning_rate": 1e-4})


def test_bad_enum_names_field_value_allowed_and_suggestion():
    with pytest.raises(ConfigError) as err:
        build_config({**BASE, "finetuning_type": "lroa"})
    msg = str(err.value)
    assert "finetuning_type: got 'lroa'; allowed: lora | oft | freeze | full (did you mean 'lora'?)" == msg


def test_wrong_type_names_field_and_value():
    with pytest.raises(ConfigError, match=r"lora_rank: got 'eight'"):
        build_config({**BASE, "lora_rank": "eight"})
    with pytest.raises(ConfigError, match=r"cutoff_len: got -5"):
        build_config({**BASE, "cutoff_len": -5})


def test_missing_required_field():
    with pytest.raises(ConfigError, match=r"model_name_or_path: required field is missing"):
        build_config({"output_dir": "o"})


def test_unsupported_lf_field_is_an_error_not_ignored():
    with pytest.raises(
        ConfigError, match=r"use_kt: LLaMA-Factory's `use_kt: true` \(KTransformers .*\) is not avail"
    ):
        build_config({**BASE, "use_kt": True})


def test_repeated_key_same_value_warns_once(tmp_path, caplog):
    path = tmp_path / "c.yaml"
    path.write_text("model_name_or_path: m\noutput_dir: o\ntemplate: qwen\ntemplate: qwen\n")
    cfg = load_config(path)
    assert cfg.data.template == "qwen"
    assert sum("repeated keys" in r.message for r in caplog.records) == 1
    assert "template (line 4)" in caplog.text


def test_repeated_key_different_value_is_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model_name_or_path: m\noutput_dir: o\ntemplate: qwen\ntemplate: llama3\n")
    with pytest.raises(
        ConfigError, match=r"template: set twice with different values \('qwen', then 'llama3'"
    ):
        load_config(path)


def test_overrides_are_typed_and_win(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model_name_or_path: m\noutput_dir: o\nlearning_rate: 1.0e-3\n")
    cfg = load_config(path, ["learning_rate=1e-4", "lora_rank=16", "--bf16", "true", "--seed=7"])
    assert cfg.training.learning_rate == 1e-4 and cfg.finetuning.lora_rank == 16
    assert cfg.training.bf16 is True and cfg.training.seed == 7
    assert parse_overrides(["template="]) == {"template": None}
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_overrides(["learning_rate"])


def test_secret_is_redacted_in_flat_view():
    cfg = build_config({**BASE, "hf_hub_token": "hf_canary_123"})
    assert cfg.flat()["hf_hub_token"] == "***"
    assert "hf_canary_123" not in repr(cfg)


def test_lf_command_line_forms_flags_bare_booleans_and_key_value():
    """Seed 001's `--key value` form with bare boolean flags, mixed with key=value and --key=value."""
    flat = parse_overrides(
        ["--stage", "sft", "--do_train", "--lora_rank", "16", "--lora_target", "q_proj,v_proj",
         "--learning_rate", "1e-4", "--max_steps", "-1", "--bf16", "--use_kt", "--seed=7", "cutoff_len=64"]
    )  # fmt: skip
    assert flat == {
        "stage": "sft", "do_train": True, "lora_rank": 16, "lora_target": "q_proj,v_proj",
        "learning_rate": 1e-4, "max_steps": -1, "bf16": True, "use_kt": True, "seed": 7, "cutoff_len": 64,
    }  # fmt: skip
    assert parse_overrides(["--bf16", "false", "--do_train", "lora_rank=8"]) == {
        "bf16": False,
        "do_train": True,
        "lora_rank": 8,
    }


def test_a_flag_that_needs_a_value_says_so():
    with pytest.raises(ConfigError, match=r"--template: missing value; write --template <value>"):
        parse_overrides(["--template"])
    with pytest.raises(ConfigError, match=r"--dataset: missing value"):
        parse_overrides(["--dataset", "--do_train"])


def test_text_fields_keep_command_line_text_as_written():
    flat = parse_overrides(
        ["--default_system", "Note: be brief", "--model_revision", "2024", "template=null"]
    )
    assert flat == {"default_system": "Note: be brief", "model_revision": "2024", "template": None}
    assert build_config({**BASE, **parse_overrides(["--fsdp", "[full_shard, auto_wrap]"])}).training.fsdp == (
        "full_shard auto_wrap"
    )


def test_yaml_exponent_without_a_dot_is_a_number_as_in_lf(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model_name_or_path: m\noutput_dir: o\nlr_scheduler_kwargs: {min_lr: 1e-6}\n")
    assert load_config(path).training.lr_scheduler_kwargs == {"min_lr": 1e-6}
