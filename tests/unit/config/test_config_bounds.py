"""Bounded, strictly typed inputs (issue 18, "Inputs"): YAML alias bombs, booleans in number fields,
AdamW betas, seed, optim names, cosine_with_min_lr and its lr_scheduler_kwargs, report_to forms."""

from __future__ import annotations

import tracemalloc

import pytest

from lmstack.config.errors import ConfigError
from lmstack.config.load import MAX_YAML_NODES, build_config, load_config, parse_overrides

BASE = {"model_name_or_path": "m", "output_dir": "o"}


def billion_laughs(depth: int = 9) -> str:
    """The classic shape, inside one schema field: level i holds 9 aliases of level i-1 (9**depth values);
    the error for `template` (a string, given a list) used to quote the whole expansion."""
    levels = ["&a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    levels += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, depth)]
    return f"model_name_or_path: m\noutput_dir: o\ntemplate: [{', '.join(levels)}]\n"


def test_yaml_alias_bomb_fails_fast_and_small(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(billion_laughs(9))
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError) as err:
            load_config(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20  # refused while counting, never expanded (9**9 values would be gigabytes)
    msg = str(err.value)
    assert len(msg) < 500
    assert f"YAML aliases expand this document past {MAX_YAML_NODES} values" in msg and str(path) in msg


def test_small_anchors_still_work(tmp_path):
    path = tmp_path / "anchors.yaml"
    path.write_text("model_name_or_path: &m m\noutput_dir: o\nref_model: *m\n")
    assert load_config(path).finetuning.ref_model == "m"


def test_recursive_alias_and_huge_documents_are_refused(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("model_name_or_path: m\noutput_dir: o\nfsdp_config: &x {a: *x}\n")
    with pytest.raises(ConfigError, match="alias refers to a node that contains it"):
        load_config(path)
    path.write_text("model_name_or_path: m\noutput_dir: o\ndefault_system: " + "x" * (2 << 20) + "\n")
    with pytest.raises(ConfigError, match="a config is at most"):
        load_config(path)
    with pytest.raises(ConfigError, match="YAML aliases expand"):
        parse_overrides(["fsdp_config=" + billion_laughs(9).splitlines()[-1].split(": ", 1)[1]])
    with pytest.raises(ConfigError, match="a key must be a plain name"):
        parse_overrides(["fsdp_config={[a]: 1}"])


def test_values_quoted_in_errors_are_truncated():
    with pytest.raises(ConfigError) as err:
        build_config({**BASE, "cutoff_len": "x" * 100_000, "lora_rank": [list(range(1000))] * 1000})
    assert len(str(err.value)) < 1000 and "cutoff_len: got 'xxxx" in str(err.value)


@pytest.mark.parametrize("field", ["lora_rank", "learning_rate", "per_device_train_batch_size", "cutoff_len"])
def test_booleans_are_not_numbers(field):
    with pytest.raises(ConfigError, match=rf"^{field}: got True; a boolean is not a number"):
        build_config({**BASE, field: True})


def test_yaml_yes_for_lora_rank_is_refused_and_bool_fields_keep_bools(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model_name_or_path: m\noutput_dir: o\nlora_rank: yes\n")
    with pytest.raises(ConfigError, match="lora_rank: got True; a boolean is not a number"):
        load_config(path)
    cfg = build_config({**BASE, "bf16": True, "gradient_checkpointing": True, "packing": False})
    assert cfg.training.bf16 is True and cfg.training.gradient_checkpointing is True


@pytest.mark.parametrize("field", ["adam_beta1", "adam_beta2"])
@pytest.mark.parametrize("value,ok", [(0.0, True), (0.95, True), (1.0, False), (1.5, False), (-0.1, False)])
def test_adam_betas_in_zero_one(field, value, ok):
    if ok:
        assert getattr(build_config({**BASE, field: value}).training, field) == value
    else:
        with pytest.raises(ConfigError, match=rf"^{field}: got {value}"):
            build_config({**BASE, field: value})


def test_negative_seed_is_refused():
    with pytest.raises(ConfigError, match=r"^seed: got -1; Input should be greater than or equal to 0"):
        build_config({**BASE, "seed": -1})
    assert build_config({**BASE, "seed": 0}).training.seed == 0


def test_unknown_optim_is_refused_naming_the_allowed_ones():
    with pytest.raises(ConfigError) as err:
        build_config({**BASE, "optim": "adamw_torh"})
    msg = str(err.value)
    assert msg.startswith("optim: got 'adamw_torh'; allowed: adamw_torch | adamw_torch_fused")
    assert "| adafactor |" in msg and msg.endswith("| muon (did you mean 'adamw_torch'?)")
    for name in ("adafactor", "paged_adamw_8bit", "muon", "sgd"):
        assert build_config({**BASE, "optim": name}).training.optim == name


def test_cosine_with_min_lr_needs_its_floor_in_lr_scheduler_kwargs():
    with pytest.raises(ConfigError) as err:
        build_config({**BASE, "lr_scheduler_type": "cosine_with_min_lr"})
    assert str(err.value).startswith(
        "lr_scheduler_type: cosine_with_min_lr needs exactly one floor in lr_scheduler_kwargs: "
        "add `lr_scheduler_kwargs: {min_lr_rate: 0.1}`"
    )
    with pytest.raises(ConfigError, match="exactly one floor"):
        build_config(
            {
                **BASE,
                "lr_scheduler_type": "cosine_with_min_lr",
                "lr_scheduler_kwargs": {"min_lr": 1, "min_lr_rate": 1},
            }
        )
    cfg = build_config(
        {**BASE, "lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 0.1}}
    )
    assert cfg.training.lr_scheduler_kwargs == {"min_lr_rate": 0.1}
    # transformers' JSON-string form, on the command line too
    flat = parse_overrides(
        ["--lr_scheduler_type", "cosine_with_min_lr", "--lr_scheduler_kwargs", '{"min_lr": 1e-6}']
    )
    assert build_config({**BASE, **flat}).training.lr_scheduler_kwargs == {"min_lr": 1e-6}
    cfg = build_config({**BASE, "lr_scheduler_kwargs": '{"num_cycles": 2}'})
    assert cfg.training.lr_scheduler_kwargs == {"num_cycles": 2}


def test_warmup_stable_decay_needs_num_decay_steps_instead_of_a_trainer_traceback(base_cfg):
    from lmstack.launch.context import LaunchContext
    from lmstack.plan.runplan import RunPlan
    from lmstack.train.common import training_arguments

    with pytest.raises(
        ConfigError, match=r"warmup_stable_decay needs .* `lr_scheduler_kwargs: \{num_decay_steps: N\}`"
    ):
        build_config({**BASE, "lr_scheduler_type": "warmup_stable_decay"})
    cfg = build_config(
        {
            **base_cfg,
            "lr_scheduler_type": "warmup_stable_decay",
            "lr_scheduler_kwargs": {"num_decay_steps": 2},
        }
    )
    args = training_arguments(RunPlan.resolve(cfg, LaunchContext.from_env()))
    assert args.lr_scheduler_kwargs == {"num_decay_steps": 2} and args.report_to == []


@pytest.mark.parametrize(
    "value,expected",
    [
        ("none", "none"), (None, "none"), (False, "none"), ([], "none"), ("tensorboard", "tensorboard"),
        (["tensorboard"], "tensorboard"), ("all", "all"), (" tensorboard , ", "tensorboard"),
        ("wandb,tensorboard", "wandb,tensorboard"), (["mlflow", "trackio", "swanlab"], "mlflow,trackio,swanlab"),
    ],
)  # fmt: skip
def test_report_to_accepts_lf_forms(value, expected):
    assert build_config({**BASE, "report_to": value}).training.report_to == expected


@pytest.mark.parametrize("value", ["neptune", "tensorboard,comet_ml", ["clearml", "wandb"]])
def test_report_to_trackers_not_there_yet_are_named(value):
    name = {"neptune": "neptune", "tensorboard,comet_ml": "comet_ml"}.get(str(value), "clearml")
    with pytest.raises(ConfigError, match=rf"^report_to: got .*; {name}: not available yet in lmstack"):
        build_config({**BASE, "report_to": value})


@pytest.mark.parametrize("value", [["all", "wandb"], "none,tensorboard"])
def test_report_to_none_or_all_stand_alone(value):
    with pytest.raises(ConfigError, match=r"`none` / `all` together with a tracker"):
        build_config({**BASE, "report_to": value})


def test_report_to_unknown_tracker_gets_a_suggestion():
    with pytest.raises(
        ConfigError,
        match=r"unknown tracker 'tensorbord'; allowed: none \| all \| tensorboard \| wandb .*\(did",
    ):
        build_config({**BASE, "report_to": "tensorbord"})
