"""`auto` values in the training YAML, resolved by the planner (config.json only, no weights)."""

import json
from pathlib import Path

import pytest

from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config
from lmstack.launch.context import LaunchContext
from lmstack.plan.runplan import RunPlan
from lmstack.plan.whatif import gpu_context

AUTO = ("deepspeed", "per_device_train_batch_size", "gradient_checkpointing")


def resolve_auto_fields(cfg, gpu_memory_gib=None) -> tuple[dict, RunPlan]:
    """The auto fields as the run plan resolves them on one GPU of that size (or on this CPU)."""
    ctx = gpu_context(1, gpu_memory_gib) if gpu_memory_gib else LaunchContext()
    plan = RunPlan.resolve(cfg, ctx)
    chosen = {k: getattr(plan.cfg.training, k) for k in AUTO if getattr(cfg.training, k) == "auto"}
    return chosen, plan


@pytest.fixture
def model_dir(tmp_path, qwen_shapes):
    """A Qwen2.5 folder with config.json only (no weights) for the given size."""

    def make(size: str) -> str:
        d = tmp_path / f"qwen2.5-{size}"
        d.mkdir()
        (d / "config.json").write_text(
            json.dumps(
                {
                    "model_type": "qwen2",
                    "architectures": ["Qwen2ForCausalLM"],
                    "max_position_embeddings": 32768,
                    **qwen_shapes[size],
                }
            )
        )
        return str(d)

    return make


def cfg_for(path: str, **kw):
    flat = {
        "model_name_or_path": path,
        "output_dir": "o",
        "cutoff_len": 2048,
        "bf16": True,
        "deepspeed": "auto",
        "per_device_train_batch_size": "auto",
        "gradient_checkpointing": "auto",
    }
    return build_config({**flat, **kw})


def test_small_model_on_an_h200_needs_no_deepspeed_and_no_recompute(model_dir, caplog):
    cfg = cfg_for(model_dir("0.5b"), finetuning_type="lora")
    chosen, plan = resolve_auto_fields(cfg, gpu_memory_gib=139.8)
    assert chosen["deepspeed"] is None and plan.deepspeed is None
    assert isinstance(plan.cfg.training.per_device_train_batch_size, int)
    assert plan.micro_batch >= 8
    assert plan.checkpointing is False
    assert plan.reasons["auto"].startswith("plan: auto ->")
    assert cfg.training.deepspeed == "auto"  # the user's config is never patched in place


def test_7b_full_on_80gb_gets_a_real_zero_template(model_dir):
    cfg = cfg_for(model_dir("7b"), finetuning_type="full")
    chosen, plan = resolve_auto_fields(cfg, gpu_memory_gib=80)
    assert chosen["deepspeed"] and Path(chosen["deepspeed"]).is_file()
    assert plan.zero_stage in (2, 3)
    ds = json.loads(Path(chosen["deepspeed"]).read_text())
    assert ds["zero_optimization"]["stage"] in (2, 3)
    assert "offload" in Path(chosen["deepspeed"]).name  # 7B full FT does not fit 80 GB without offload
    assert plan.micro_batch >= 1


def test_less_memory_buys_room_with_recompute_not_with_an_oom(model_dir):
    path = model_dir("0.5b")
    for memory in (24, 40, 139.8):
        cfg = cfg_for(path, finetuning_type="full", deepspeed=None)
        _, plan = resolve_auto_fields(cfg, gpu_memory_gib=memory)
        assert "WARNING nothing fits" not in plan.reasons["auto"], memory
        if memory == 139.8:  # plenty of memory: no recompute cost
            assert plan.checkpointing is False


def test_cpu_resolution_is_plain_and_logged(model_dir, caplog):
    cfg = cfg_for(model_dir("0.5b"), use_cpu=True)
    chosen, plan = resolve_auto_fields(cfg)
    assert chosen == {"deepspeed": None, "per_device_train_batch_size": 1, "gradient_checkpointing": False}
    assert "auto on CPU" in plan.reasons["auto"]


def test_auto_batch_with_a_token_budget_is_an_error(model_dir):
    cfg = cfg_for(model_dir("0.5b"), packing=True, max_tokens_per_batch=16384)
    with pytest.raises(ConfigError, match="per_device_train_batch_size: auto cannot be combined"):
        resolve_auto_fields(cfg, gpu_memory_gib=80)


def test_bad_values_still_rejected():
    with pytest.raises(ConfigError, match="per_device_train_batch_size: got 'big'"):
        build_config({"model_name_or_path": "m", "output_dir": "o", "per_device_train_batch_size": "big"})
    with pytest.raises(ConfigError, match="per_device_train_batch_size: got 0"):
        build_config({"model_name_or_path": "m", "output_dir": "o", "per_device_train_batch_size": 0})
