"""use_unsloth_gc (LF's field): a checkpointing mode of the run plan (plan.checkpoint_offload), its
refusals, and the planner's "offloaded" mode -- GPU activations below full checkpointing's, the layer
inputs as a CPU term, and the recommendation taking it where it is the cheapest way to fit."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config
from lmstack.launch.context import LaunchContext
from lmstack.memory import memory as mem
from lmstack.memory import plan
from lmstack.memory.estimate import Setup, estimate
from lmstack.memory.model_spec import ModelSpec
from lmstack.memory.recommend import relative_cost
from lmstack.plan.runplan import RunPlan
from lmstack.plan.whatif import gpu_context, request_from_config
from lmstack.train.preflight import check

CPU = LaunchContext()
QWEN_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)  # fmt: skip
EVERYTHING = frozenset({"deepspeed", "bitsandbytes", "liger_kernel"})


def resolve(base_cfg, **over) -> RunPlan:
    return RunPlan.resolve(build_config({**base_cfg, **over}), CPU)


def test_use_unsloth_gc_is_offloaded_checkpointing_in_the_plan(base_cfg):
    p = resolve(base_cfg, use_unsloth_gc=True)
    assert p.checkpointing and p.checkpoint_offload  # LF: it turns checkpointing on
    assert "use_unsloth_gc: true" in p.reasons["checkpoint_offload"]
    assert p.decisions()["checkpoint_offload"] is True
    plain = resolve(base_cfg, gradient_checkpointing=True)
    assert plain.checkpointing and not plain.checkpoint_offload
    # LF: use_unsloth_gc errors with KTransformers; lmstack refuses use_kt: true itself
    with pytest.raises(ConfigError, match="use_kt"):
        build_config({**base_cfg, "use_unsloth_gc": True, "use_kt": True})


@pytest.mark.parametrize(
    "over,named",
    [
        ({"gradient_checkpointing": False}, "gradient_checkpointing: false"),
        ({"disable_gradient_checkpointing": True}, "disable_gradient_checkpointing: true"),
    ],
)
def test_use_unsloth_gc_with_checkpointing_turned_off_is_refused_naming_both(base_cfg, over, named):
    with pytest.raises(ConfigError, match=f"use_unsloth_gc: true and {named}: .*remove one of them"):
        resolve(base_cfg, use_unsloth_gc=True, **over)


@pytest.mark.parametrize(
    "over,what", [({"deepspeed": "z3"}, "DeepSpeed ZeRO-3"), ({"fsdp": "full_shard auto_wrap"}, "FSDP")]
)
def test_use_unsloth_gc_with_sharded_weights_is_refused(base_cfg, over, what):
    with pytest.raises(ConfigError, match=f"use_unsloth_gc: true with {what}: .*DDP or ZeRO-1/2"):
        resolve(base_cfg, use_unsloth_gc=True, **over)


def test_use_unsloth_gc_composes_with_zero2(base_cfg):
    p = resolve(base_cfg, use_unsloth_gc=True, deepspeed="z2")
    assert p.zero_stage == 2 and p.checkpoint_offload


# ---- the planner -------------------------------------------------------------------------------


@pytest.fixture
def qwen7b(tmp_path):
    d = tmp_path / "qwen2.5-7b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["X"], **QWEN_7B}))
    return str(d)


def test_offloaded_mode_keeps_less_on_the_gpu_and_puts_the_layer_inputs_in_cpu_ram(qwen7b):
    spec = ModelSpec.from_pretrained_dir(qwen7b)
    full = Setup(
        finetuning_type="lora", micro_batch=8, seq_len=2048, gradient_checkpointing=True, fused_ce=True
    )
    off = replace(full, checkpoint_offload=True)
    e_full, e_off = estimate(spec, full), estimate(spec, off)
    inputs_gib = 28 * 8 * 2048 * 3584 * 2 / mem.GIB  # layers x tokens x hidden x bf16
    assert e_off.offloaded_activations_gib == pytest.approx(inputs_gib)
    assert e_off.cpu_gib == pytest.approx(e_full.cpu_gib + inputs_gib)
    # the GPU keeps one recomputed layer, its input and the prefetched one, not all 28 inputs
    assert e_full.gpu.activations - e_off.gpu.activations == pytest.approx(inputs_gib * 26 / 28)
    assert e_off.gpu.allocated < e_full.gpu.allocated and e_off.gpu.total < e_full.gpu.total
    # part of the saving comes back as reserved-only blocks (memory.offload_pending_bytes)
    assert e_off.gpu.reserved - e_off.gpu.allocated > e_full.gpu.reserved - e_full.gpu.allocated
    # the copies hide behind the 7B step's compute: only the fixed share is paid over full checkpointing
    assert relative_cost(spec, off) == pytest.approx(relative_cost(spec, full) * 1.02)


def test_offloaded_mode_costs_the_pcie_time_the_compute_cannot_hide(qwen7b):
    spec = replace(ModelSpec.from_pretrained_dir(qwen7b), num_params=50_000_000)  # little compute per token
    full = Setup(
        finetuning_type="lora", micro_batch=8, seq_len=2048, gradient_checkpointing=True, fused_ce=True
    )
    off = replace(full, checkpoint_offload=True)
    assert relative_cost(spec, off) > relative_cost(spec, full) * 1.5


def request(path, gib, cpu=None, **kw):
    yaml = dict(output_dir="o", bf16=True, cutoff_len=2048, packing=True, finetuning_type="lora",
                lora_target="all", per_device_train_batch_size=8, gradient_accumulation_steps=1,
                gradient_checkpointing=False, model_name_or_path=path, **kw)  # fmt: skip
    return replace(request_from_config(build_config(yaml), 1, gib, cpu_memory_gib=cpu), available=EVERYTHING)


def test_26gb_7b_lora_8x2048_picks_offloaded_checkpointing(qwen7b):
    """7B LoRA 8 x 2048 in bf16 on 26.3 GiB: full checkpointing fits only at micro-batch 4 (24.5 GiB at 8 >
    24.2 usable, transformers' own SwiGLU backward on top of the recompute included); with the layer inputs
    in CPU RAM micro-batch 8 fits (23.9), and that is the cheapest setup. On
    24 GiB the offloaded row's reserved-only margin (its pending copies, memory.offload_pending_bytes) puts
    it just over too, and the recommendation is full checkpointing at micro-batch 4 x 2 accumulation."""
    at24 = plan(request(qwen7b, 24)).recommendation
    assert not at24.candidate.setup.checkpoint_offload and at24.candidate.setup.micro_batch == 4
    assert at24.yaml_changes["gradient_accumulation_steps"] == 2
    result = plan(request(qwen7b, 26.3))
    rec = result.recommendation
    s = rec.candidate.setup
    assert s.checkpoint_offload and s.gradient_checkpointing and s.micro_batch == 8
    assert rec.candidate.strategy.name == "single" and not rec.candidate.changes_method
    assert rec.yaml_changes["use_unsloth_gc"] is True and rec.yaml_changes["gradient_checkpointing"] is True
    assert "offloaded (use_unsloth_gc)" in rec.reason and "estimate" in rec.reason
    full_mb8 = [c for c in result.candidates if c.strategy.name == "single" and c.setup.micro_batch == 8
                and c.setup.gradient_checkpointing and not c.setup.checkpoint_offload and c.setup.fused_ce]  # fmt: skip
    assert full_mb8 and not any(c.fits for c in full_mb8)


def test_the_offloaded_recommendation_is_accepted_by_check(qwen7b, base_cfg):
    """Its YAML changes on a config (the tiny model in place of the 7B one) pass `lmstack check`'s rules on
    the 26.3 GiB GPU, and the real `lmstack check` on this CPU box."""
    from lmstack.cli.check import run_check

    here = LaunchContext.from_env(probe_cuda=False).packages
    rec = plan(replace(request(qwen7b, 26.3, cpu=512), available=here)).recommendation
    assert rec.yaml_changes.get("use_unsloth_gc") is True
    flat = {**base_cfg, **rec.yaml_changes, "bf16": True}
    p = RunPlan.resolve(build_config(flat), replace(gpu_context(1, 26.3), packages=here))
    check(p, launch=False)  # raises ConfigError on a refusal
    assert p.checkpoint_offload and p.checkpointing
    report, _ = run_check(None, {**flat, "bf16": False})
    assert report["totals"]["problems"] == 0


def test_offloaded_mode_is_checked_against_cpu_ram(qwen7b):
    result = plan(request(qwen7b, 24, cpu=2))
    off = [c for c in result.candidates if c.setup.checkpoint_offload and c.setup.micro_batch == 8]
    assert off and all(not c.fits for c in off)
    assert any(c.why_not.startswith("CPU:") for c in off)
    assert not result.recommendation.candidate.setup.checkpoint_offload


def test_offloaded_mode_is_never_proposed_with_zero3_or_fsdp(qwen7b):
    result = plan(replace(request(qwen7b, 24), num_gpus=2))
    offloaded = [c for c in result.candidates if c.setup.checkpoint_offload]
    assert {c.strategy.name for c in offloaded} >= {"ddp", "zero2", "zero1", "zero2_offload"}
    assert not [c for c in offloaded if c.setup.deepspeed_stage == 3 or c.setup.fsdp]
    # and a configured use_unsloth_gc under ZeRO-3 is named as unsupported, not estimated as if it ran
    s = replace(offloaded[0].setup, deepspeed_stage=3, fsdp=None)
    from lmstack.memory.advice import unsupported

    assert "use_unsloth_gc" in unsupported(result.request, s)


def test_deepspeed_auto_never_falls_back_to_zero3_with_use_unsloth_gc(qwen7b):
    """deepspeed: auto with use_unsloth_gc, where nothing fits: the smallest setup it falls back to is not a
    ZeRO-3 row (use_unsloth_gc is refused there), so the run plan resolves and says nothing fits."""
    yaml = dict(output_dir="o", bf16=True, cutoff_len=2048, packing=True, finetuning_type="full",
                per_device_train_batch_size=8, use_unsloth_gc=True, deepspeed="auto", model_name_or_path=qwen7b)  # fmt: skip
    ctx = replace(gpu_context(1, 24), packages=EVERYTHING)
    p = RunPlan.resolve(build_config(yaml), ctx)
    assert p.checkpoint_offload and (p.deepspeed is None or p.deepspeed.zero_stage != 3)
    assert any("nothing fits" in n for n in p.notes)


def test_a_recommendation_that_recomputes_lifts_disable_gradient_checkpointing(qwen7b, base_cfg):
    """disable_gradient_checkpointing: true (LF's switch) would keep a recommended checkpointing off: the
    YAML changes turn it back to false, and applied they give a plan that recomputes."""
    yaml = dict(output_dir="o", bf16=True, cutoff_len=2048, packing=True, finetuning_type="lora",
                lora_target="all", per_device_train_batch_size=8, disable_gradient_checkpointing=True,
                model_name_or_path=qwen7b)  # fmt: skip
    req = replace(request_from_config(build_config(yaml), 1, 24), available=EVERYTHING)
    assert req.checkpointing_disabled
    changes = plan(req).recommendation.yaml_changes
    assert changes["disable_gradient_checkpointing"] is False and changes["gradient_checkpointing"] in (
        True,
        "auto",
    )
    p = RunPlan.resolve(build_config({**yaml, **changes}), replace(gpu_context(1, 24), packages=EVERYTHING))
    assert p.checkpointing
