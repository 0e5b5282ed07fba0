"""The recommendation is the fastest setup that fits, searched over checkpointing, micro-batch (keeping
the optimizer's batch), ZeRO stage/offload and QLoRA, under GPU, CPU and what is installed -- and every
YAML change it prints is accepted by `lmstack check`'s rules."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from lmstack.config.load import build_config
from lmstack.memory import format_table, plan
from lmstack.plan.runplan import RunPlan
from lmstack.plan.whatif import gpu_context, request_from_config
from lmstack.train.preflight import check

QWEN_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)  # fmt: skip
LLAMA2_70B = dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8)  # fmt: skip
EVERYTHING = frozenset({"deepspeed", "bitsandbytes", "liger_kernel"})


@pytest.fixture
def big(tmp_path):
    def make(name: str) -> str:
        model_type, shape = {"qwen2.5-7b": ("qwen2", QWEN_7B), "llama-2-70b": ("llama", LLAMA2_70B)}[name]
        d = tmp_path / name
        d.mkdir(exist_ok=True)
        (d / "config.json").write_text(
            json.dumps({"model_type": model_type, "architectures": ["X"], **shape})
        )
        return str(d)

    return make


YAML = dict(output_dir="o", bf16=True, cutoff_len=2048, packing=True, finetuning_type="lora", lora_target="all",
            per_device_train_batch_size=2, gradient_accumulation_steps=8, gradient_checkpointing=False)  # fmt: skip


def request(path, gib, available=EVERYTHING, cpu=None, **kw):
    req = request_from_config(
        build_config({**YAML, "model_name_or_path": path, **kw}), 1, gib, cpu_memory_gib=cpu
    )
    return replace(req, available=available)


def test_7b_lora_on_one_24gb_gpu_is_single_gpu_with_checkpointing(big):
    """Was: ZeRO-3 offload (cost 5.22) because the YAML's micro-batch and checkpointing were held fixed."""
    result = plan(request(big("qwen2.5-7b"), 24))
    rec = result.recommendation.candidate
    assert rec.strategy.name == "single" and rec.setup.gradient_checkpointing and not rec.changes_method
    assert not rec.setup.offload_optimizer and rec.cost < 1.6
    changes = result.recommendation.yaml_changes
    assert changes["gradient_checkpointing"] is True
    mb = changes.get("per_device_train_batch_size", 2)
    assert mb * changes.get("gradient_accumulation_steps", 8) == 16  # the optimizer's batch is kept


@pytest.mark.parametrize("cpu", [128, 2048])
def test_70b_lora_on_one_80gb_gpu_is_qlora_with_checkpointing(big, cpu):
    """Was: ZeRO-3 offload needing ~198 GiB of CPU RAM, because QLoRA 'changes the method'. With enough
    CPU RAM offload fits, but is still far slower than QLoRA + checkpointing."""
    result = plan(request(big("llama-2-70b"), 80, cpu=cpu))
    rec = result.recommendation
    assert rec.candidate.strategy.method == "qlora4" and rec.candidate.setup.gradient_checkpointing
    assert rec.yaml_changes["quantization_bit"] == 4 and "THIS CHANGES THE METHOD" in rec.reason
    offload = [c for c in result.candidates if c.strategy.name == "zero3_offload"]
    assert any(c.fits for c in offload) == (cpu == 2048)
    if cpu == 128:
        assert all(c.why_not.startswith(("CPU:", "GPU:")) for c in offload)


def test_rows_this_machine_cannot_run_are_rejected_with_the_reason(big):
    result = plan(request(big("qwen2.5-7b"), 24, available=frozenset()))
    rec = result.recommendation
    assert "deepspeed" not in rec.yaml_changes and "quantization_bit" not in rec.yaml_changes
    assert "enable_liger_kernel" not in rec.yaml_changes and "flash_attn" not in rec.yaml_changes
    table = format_table(result)
    assert "unsupported here: DeepSpeed is not installed" in table
    assert "unsupported here: quantization needs bitsandbytes" in table


def test_ppo_is_never_told_to_use_deepspeed(big):
    req = request(big("qwen2.5-7b"), 24, stage="ppo", reward_model="rm", packing=False, cutoff_len=512)
    result = plan(req)
    assert all(
        c.why_not.startswith("unsupported combination")
        for c in result.candidates
        if c.setup.deepspeed_stage is not None
    )
    assert result.recommendation is None or "deepspeed" not in result.recommendation.yaml_changes


CASES = [
    ("qwen2.5-7b", 24, {}),
    ("qwen2.5-7b", 80, {"finetuning_type": "full"}),
    ("llama-2-70b", 80, {}),
    ("qwen2.5-7b", 24, {"flash_attn": "disabled"}),
    ("qwen2.5-7b", 40, {"stage": "dpo", "packing": False, "cutoff_len": 1024}),
]


@pytest.mark.parametrize(("name", "gib", "kw"), CASES)
def test_every_recommended_change_is_accepted_by_check(big, tiny_model, base_cfg, name, gib, kw):
    """Each recommendation's YAML changes, applied to a config (the tiny model in place of the big one:
    the changes do not depend on it), pass the rules `lmstack check` applies, on the target GPU with
    the packages installed here; those that need no GPU also pass the real `lmstack check` here."""
    from lmstack.cli.check import run_check
    from lmstack.launch.context import LaunchContext

    here = LaunchContext.from_env(probe_cuda=False).packages
    rec = plan(request(big(name), gib, available=here, cpu=512, **kw)).recommendation
    assert rec is not None
    flat = {**base_cfg, **kw, **rec.yaml_changes, "bf16": True}
    if kw.get("stage") == "dpo":
        flat["dataset"] = "dpo_en_demo"
    ctx = gpu_context(1, gib)
    ctx = replace(ctx, packages=here)
    check(RunPlan.resolve(build_config(flat), ctx), launch=False)  # raises ConfigError on a refusal
    if "quantization_bit" not in rec.yaml_changes and "deepspeed" not in rec.yaml_changes:
        report, _ = run_check(None, {**flat, "bf16": False})  # this CPU box: the real `lmstack check`
        assert report["totals"]["problems"] == 0
