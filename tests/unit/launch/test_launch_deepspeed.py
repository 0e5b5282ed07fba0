"""DeepSpeed JSON validation, "auto" handling, the shipped templates, TORCH_CUDA_ARCH_LIST."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmstack.config.errors import ConfigError
from lmstack.launch import deepspeed as ds

REPO = Path(__file__).resolve().parents[3]
DS_DIR = REPO / "examples/deepspeed"
TEMPLATES = {
    "ds_z0_config.json": 0,
    "ds_z1_config.json": 1,
    "ds_z2_config.json": 2,
    "ds_z2_offload_config.json": 2,
    "ds_z3_config.json": 3,
    "ds_z3_offload_config.json": 3,
}


@pytest.mark.parametrize("name,stage", TEMPLATES.items())
def test_shipped_templates_validate_and_leave_batch_to_the_yaml(name, stage):
    config = ds.load_deepspeed_config(ds.TEMPLATE_DIR / name)
    assert ds.zero_stage(config) == stage
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        assert config[key] == "auto", key
    assert config["gradient_clipping"] == "auto"
    assert config["bf16"]["enabled"] == "auto" and config["fp16"]["enabled"] == "auto"
    zero = config["zero_optimization"]
    if stage == 3:
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True  # real weights at save
        assert zero["reduce_bucket_size"] == "auto" and zero["stage3_prefetch_bucket_size"] == "auto"
    offload = "offload" in name
    assert ("offload_optimizer" in zero) == offload
    assert ("offload_param" in zero) == (offload and stage == 3)


def test_shipped_set_is_complete_and_names_cover_it():
    shipped = {p.name for p in ds.TEMPLATE_DIR.glob("*.json")}
    assert shipped == set(TEMPLATES) == set(ds.TEMPLATES.values())
    assert {p.name for p in DS_DIR.glob("*.json")} >= shipped


@pytest.mark.parametrize("name", TEMPLATES)
def test_examples_folder_holds_the_same_files_as_the_package(name):
    """examples/deepspeed/ stays for LLaMA-Factory users; it must not drift from what ships."""
    assert (DS_DIR / name).read_bytes() == (ds.TEMPLATE_DIR / name).read_bytes()


@pytest.mark.parametrize(
    "ref",
    ["z3_offload", "ds_z3_offload_config", "ds_z3_offload_config.json",
     "examples/deepspeed/ds_z3_offload_config.json", "./examples/deepspeed/ds_z3_offload_config.json"],
)  # fmt: skip
def test_template_names_resolve_from_any_working_directory(ref, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert ds.resolve_deepspeed_ref(ref) == ds.TEMPLATE_DIR / "ds_z3_offload_config.json"
    zero = ds.load_deepspeed_config(ref)["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"]["device"] == "cpu"


def test_an_existing_file_wins_over_a_template_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "z3").write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    local = tmp_path / "examples/deepspeed/ds_z3_config.json"
    local.parent.mkdir(parents=True)
    local.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    assert ds.zero_stage(ds.load_deepspeed_config("z3")) == 1
    assert ds.zero_stage(ds.load_deepspeed_config("examples/deepspeed/ds_z3_config.json")) == 2
    assert ds.zero_stage(ds.load_deepspeed_config("z3_offload")) == 3  # no such file here: the template


@pytest.mark.parametrize(
    ("ref", "suggestion"),
    [("z4", ""), ("z3_ofload", " (did you mean 'z3_offload'?)"),
     ("ds_z2_ofload_config.json", " (did you mean 'z2_offload'?)")],
)  # fmt: skip
def test_unknown_name_lists_the_templates(ref, suggestion, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        ds.load_deepspeed_config(ref)
    assert str(err.value) == (
        f"deepspeed: {ref} not found: no such file, and not a shipped template; set a path to a DeepSpeed "
        f"JSON or a template name: z0 | z1 | z2 | z2_offload | z3 | z3_offload{suggestion}"
    )


def test_a_missing_file_elsewhere_is_not_replaced_by_a_template(tmp_path):
    """Only a bare name or the examples/deepspeed/ form means a template: /my/dir/ds_z3_config.json
    missing is an error, not silently the shipped file."""
    with pytest.raises(ConfigError, match=r"ds_z3_config.json not found: no such file"):
        ds.resolve_deepspeed_ref(tmp_path / "ds_z3_config.json")


def _planner_deepspeed_values() -> list[tuple[str, int, bool, bool]]:
    """(deepspeed value, stage, offload_optimizer, offload_param) for every ZeRO strategy the planner
    considers, on one and on eight GPUs, as yaml_changes writes it."""
    from transformers import Qwen2Config

    from lmstack.memory import ModelSpec, PlanRequest
    from lmstack.memory.recommend import candidate_strategies, search, yaml_changes

    spec = ModelSpec.from_config(
        Qwen2Config(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                    num_attention_heads=16, num_key_value_heads=4)
    )  # fmt: skip
    out = set()
    for gpus in (1, 8):
        req = PlanRequest(spec=spec, num_gpus=gpus, micro_batch=1, gradient_checkpointing=True, fused_ce=True)
        for strategy in candidate_strategies(req):
            for cand in search(req, [strategy]):
                value = yaml_changes(req, cand).get("deepspeed")
                if value is not None:
                    s = cand.setup
                    out.add((value, s.deepspeed_stage, s.offload_optimizer, s.offload_param))
    return sorted(out)


def test_the_planner_offers_every_zero_stage():
    assert {stage for _, stage, _, _ in _planner_deepspeed_values()} == {1, 2, 3}


@pytest.mark.parametrize(
    ("value", "stage", "offload_optimizer", "offload_param"), _planner_deepspeed_values()
)
def test_every_deepspeed_value_the_planner_recommends_loads_far_from_the_checkout(
    value, stage, offload_optimizer, offload_param, tmp_path, monkeypatch
):
    from lmstack.plan.auto import find_template

    monkeypatch.chdir(tmp_path)
    config = ds.load_deepspeed_config(value)
    zero = config["zero_optimization"]
    assert (ds.zero_stage(config), "offload_optimizer" in zero, "offload_param" in zero) == (
        stage, offload_optimizer, offload_param
    )  # fmt: skip
    assert ds.load_deepspeed_config(find_template(value)) == config  # deepspeed: auto takes the same file


def _write(tmp_path: Path, config) -> Path:
    path = tmp_path / "ds.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return path


def test_missing_file_names_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"deepspeed: .*nope.json not found: no such file"):
        ds.load_deepspeed_config(tmp_path / "nope.json")


def test_invalid_json_names_line_and_column(tmp_path):
    path = _write(tmp_path, '{\n  "zero_optimization": {"stage": 2},\n}')
    with pytest.raises(ConfigError, match=r"not valid JSON \(line 3, column 1.*no trailing commas"):
        ds.load_deepspeed_config(path)


def test_top_level_typo_gets_did_you_mean(tmp_path):
    path = _write(tmp_path, {"train_micro_batch_size_per_gpus": "auto", "zero_optimization": {"stage": 2}})
    with pytest.raises(
        ConfigError,
        match=r"train_micro_batch_size_per_gpus: unknown DeepSpeed key \(did you mean "
        r"'train_micro_batch_size_per_gpu'\?\)",
    ):
        ds.load_deepspeed_config(path)


def test_zero_typo_gets_did_you_mean(tmp_path):
    path = _write(
        tmp_path, {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weight_on_model_save": True}}
    )
    with pytest.raises(
        ConfigError,
        match=r"zero_optimization.stage3_gather_16bit_weight_on_model_save: unknown DeepSpeed key "
        r"\(did you mean 'stage3_gather_16bit_weights_on_model_save'\?\)",
    ):
        ds.load_deepspeed_config(path)


def test_unrelated_unknown_key_is_a_warning_not_an_error(tmp_path, caplog):
    path = _write(tmp_path, {"my_site_note": "x", "zero_optimization": {"stage": 1}})
    assert ds.load_deepspeed_config(path)["my_site_note"] == "x"
    assert "my_site_note: not a DeepSpeed key lmstack knows" in caplog.text


def test_underscore_keys_are_comments_ignored_at_every_level(tmp_path, caplog):
    """LF's own DeepSpeed files carry `"_comment"` keys: neither refused (`_stage` is close to `stage`)
    nor warned about nor handed to DeepSpeed."""
    path = _write(
        tmp_path,
        {
            "_comment": "ZeRO-2 for 8 GPUs",
            "train_micro_batch_size_per_gpu": "auto",
            "zero_optimization": {
                "stage": 2,
                "_stage": "2 saves memory",
                "offload_optimizer": {"_note": "x"},
            },
        },
    )
    config = ds.load_deepspeed_config(path)
    assert config == {
        "train_micro_batch_size_per_gpu": "auto",
        "zero_optimization": {"stage": 2, "offload_optimizer": {}},
    }
    assert "_comment" not in caplog.text and "_stage" not in caplog.text


def test_bad_stage_and_param_offload_below_stage3(tmp_path):
    path = _write(tmp_path, {"zero_optimization": {"stage": 4}})
    with pytest.raises(ConfigError, match=r"zero_optimization.stage: got 4; allowed: 0 \| 1 \| 2 \| 3"):
        ds.load_deepspeed_config(path)
    path = _write(tmp_path, {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    with pytest.raises(ConfigError, match=r"offload_param: parameter offload needs stage 3"):
        ds.load_deepspeed_config(path)


def test_auto_where_nobody_fills_it_is_an_error(tmp_path):
    path = _write(
        tmp_path, {"steps_per_print": "auto", "zero_optimization": {"stage": 3, "sub_group_size": "auto"}}
    )
    with pytest.raises(ConfigError) as err:
        ds.load_deepspeed_config(path)
    assert 'steps_per_print: "auto" is not filled by anyone here' in str(err.value)
    assert 'zero_optimization.sub_group_size: "auto"' in str(err.value)


def test_seed_000_full_zero3_config_is_accepted_and_resolved(tmp_path):
    """Seed 000 §2.1's production ZeRO-3 config, every key (comments removed)."""
    config = {
        "bf16": {"enabled": "auto"},
        "fp16": {
            "enabled": "auto",
            "loss_scale": 0,
            "loss_scale_window": 1000,
            "initial_scale_power": 16,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "sub_group_size": 1e9,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "activation_checkpointing": {
            "partition_activations": True,
            "cpu_checkpointing": False,
            "contiguous_memory_optimization": False,
            "number_checkpoints": None,
            "synchronize_checkpoint_boundary": False,
            "profile": False,
        },
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
        "communication_data_type": "auto",
    }
    loaded = ds.load_deepspeed_config(_write(tmp_path, config))
    assert ds.resolve_config(loaded, bf16=True, fp16=False)["communication_data_type"] == "bf16"
    assert ds.resolve_config(loaded, bf16=False, fp16=True)["communication_data_type"] == "fp16"
    assert ds.resolve_config(loaded, bf16=False, fp16=False)["communication_data_type"] == "fp32"
    assert loaded["communication_data_type"] == "auto"  # resolve_config does not modify its input


def test_trainer_fills_auto_from_the_yaml(base_cfg):
    """The Trainer integration fills batch, accumulation, clipping and precision from the YAML."""
    pytest.importorskip("deepspeed")
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    from lmstack.config.load import build_config
    from lmstack.launch.prepare import deepspeed_for_trainer
    from lmstack.train.common import training_arguments

    cfg = build_config(
        {
            **base_cfg,
            "deepspeed": str(DS_DIR / "ds_z2_config.json"),
            "gradient_accumulation_steps": 3,
            "max_grad_norm": 0.5,
        }
    )
    args = training_arguments(cfg, "cpu")
    assert isinstance(args.hf_deepspeed_config, HfTrainerDeepSpeedConfig)
    filled = args.hf_deepspeed_config.config
    assert filled["train_micro_batch_size_per_gpu"] == 4 and filled["gradient_accumulation_steps"] == 3
    assert (
        filled["gradient_clipping"] == 0.5 and deepspeed_for_trainer(cfg)["zero_optimization"]["stage"] == 2
    )


def test_a_gpu_machine_without_the_deepspeed_package_is_told_to_install_it(base_cfg):
    from dataclasses import replace

    from lmstack.config.load import build_config
    from lmstack.plan.rules import check_rules
    from lmstack.plan.runplan import RunPlan
    from lmstack.plan.whatif import gpu_context

    cfg = build_config({**base_cfg, "deepspeed": str(DS_DIR / "ds_z2_config.json")})
    on_gpu = RunPlan.resolve(cfg, replace(gpu_context(1, 80), packages=frozenset()))
    _, problems = check_rules(on_gpu, launch=True)
    assert any("the `deepspeed` package is not installed; pip install deepspeed" in p for p in problems)


def test_a_cpu_only_machine_is_not_told_to_install_deepspeed(base_cfg):
    """There DeepSpeed cannot train at all (the install only moves the crash into mpi4py): preflight's
    device check says to drop it instead."""
    from lmstack.config.load import build_config
    from lmstack.launch.context import LaunchContext
    from lmstack.plan.runplan import RunPlan
    from lmstack.train import preflight

    cfg = build_config({**base_cfg, "deepspeed": str(DS_DIR / "ds_z2_config.json")})
    with pytest.raises(ConfigError) as err:
        preflight.check(RunPlan.resolve(cfg, LaunchContext(packages=frozenset())), launch=True)
    assert "needs a CUDA GPU and this machine has none" in str(err.value)
    assert "pip install deepspeed" not in str(err.value)


@pytest.mark.parametrize(
    "raw,fixed",
    [
        ("9.0a", "9.0"),
        ("8.0;9.0a", "8.0;9.0"),
        ("9.0a 10.0a+PTX", "9.0;10.0+PTX"),
        ("9.0;9.0a", "9.0"),
        ("10.0f", "10.0"),
    ],
)
def test_arch_list_suffixes_are_normalised(raw, fixed):
    env = {"TORCH_CUDA_ARCH_LIST": raw}
    note = ds.normalize_arch_list(env)
    assert env["TORCH_CUDA_ARCH_LIST"] == fixed
    assert note and repr(raw) in note and repr(fixed) in note


@pytest.mark.parametrize("raw", ["9.0", "8.0;9.0+PTX", "8.0 9.0"])
def test_clean_arch_lists_are_left_alone(raw):
    env = {"TORCH_CUDA_ARCH_LIST": raw}
    assert ds.normalize_arch_list(env) is None and env["TORCH_CUDA_ARCH_LIST"] == raw
    assert ds.normalize_arch_list({}) is None
