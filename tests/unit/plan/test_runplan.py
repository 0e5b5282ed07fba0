"""The run plan: every decision taken once, with its reason, from the config and the launch context;
the config is never changed by it; what the planner recommends is what `check` accepts."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from chatml_tokenizer import write_chatml_tokenizer
from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config
from lmstack.launch.context import LaunchContext
from lmstack.memory import plan
from lmstack.plan.from_config import request_from_plan
from lmstack.plan.runplan import RunPlan
from lmstack.plan.whatif import gpu_context, plan_for

CPU = LaunchContext()


def resolve(base_cfg, ctx=CPU, **over) -> RunPlan:
    return RunPlan.resolve(build_config({**base_cfg, **over}), ctx)


def test_pt_on_a_gpu_packs_and_trains_with_the_document_mask_and_the_planner_plans_it_packed(base_cfg):
    # before: pt packed its rows but loaded the model with SDPA, and the planner planned it unpacked
    p = resolve(base_cfg, gpu_context(1, 80), stage="pt", dataset="c4_demo")
    assert p.packing and p.split_long_texts and p.row_capacity == 128
    assert p.attention == "flex_attention"
    assert p.model_spec().attention == "flex_attention"
    req = request_from_plan(p, 1, 80)
    assert req.packing and req.attention == "flash"
    assert "pt packs by default" in p.reasons["packing"]


def test_pt_with_streaming_reads_texts_one_by_one(base_cfg):
    p = resolve(base_cfg, stage="pt", dataset="c4_demo", streaming=True)
    assert not p.packing and not p.split_long_texts and "streaming" in p.reasons["packing"]


def test_sft_packing_follows_the_field(base_cfg):
    assert not resolve(base_cfg).packing
    assert resolve(base_cfg, packing=True).packing
    with pytest.raises(ConfigError, match="packing: supported for stage pt and sft, not dpo"):
        resolve(base_cfg, stage="dpo", packing=True)


def test_gradient_checkpointing_auto_is_resolved_in_the_plan_not_patched_into_the_config(base_cfg):
    cfg = build_config({**base_cfg, "gradient_checkpointing": "auto", "per_device_train_batch_size": "auto"})
    p = RunPlan.resolve(cfg, CPU)
    assert cfg.training.gradient_checkpointing == "auto"  # the validated config is never mutated
    assert cfg.training.per_device_train_batch_size == "auto"
    assert p.checkpointing is False and p.micro_batch == 1
    assert p.cfg.training.gradient_checkpointing is False and "auto" in p.reasons["checkpointing"]


def test_pure_bf16_without_bf16_trains_in_bf16(base_cfg):
    # before: pure_bf16 without bf16 loaded fp32 weights and trained in float32
    p = resolve(base_cfg, pure_bf16=True, finetuning_type="full")
    assert (p.precision.compute, p.precision.load, p.precision.autocast) == ("bf16", "bf16", None)
    assert p.model_spec().load_dtype == "bf16"
    with pytest.raises(ConfigError, match="pure_bf16 and deepspeed ZeRO-3"):
        resolve(base_cfg, pure_bf16=True, deepspeed="z3")


def test_use_unsloth_is_refused_not_ignored(base_cfg):
    from lmstack.train import preflight

    with pytest.raises(ConfigError, match="use_unsloth: true needs a CUDA GPU"):
        preflight.check(resolve(base_cfg, use_unsloth=True))


def test_every_problem_is_reported_at_once(base_cfg):
    from lmstack.train import preflight

    p = resolve(base_cfg, use_unsloth=True, fsdp_config={"version": 2}, template="no-such-template")
    with pytest.raises(ConfigError) as err:
        preflight.check(p)
    msg = str(err.value)
    assert msg.startswith("3 problems in the config")
    assert "use_unsloth" in msg and "fsdp_config" in msg and "no-such-template" in msg


def test_deepspeed_is_read_once_by_name_from_any_directory(base_cfg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = resolve(base_cfg, deepspeed="z3_offload", bf16=True)
    assert p.zero_stage == 3 and p.deepspeed.offload_optimizer and p.deepspeed.offload_param
    assert p.loss_kernel == "none" and "ZeRO-3" in p.reasons["loss_kernel"]


def test_fsdp_field_takes_lf_list_and_needs_several_processes(base_cfg):
    from lmstack.train import preflight

    p = resolve(base_cfg, fsdp=["shard_grad_op", "auto_wrap"])
    assert p.fsdp.sharding == "SHARD_GRAD_OP" and p.fsdp.source == "yaml"
    preflight.check(p, launch=False)  # `lmstack check` accepts it
    with pytest.raises(ConfigError, match="fsdp: 'shard_grad_op auto_wrap' shards over several processes"):
        preflight.check(p)  # training it in one process is refused
    two = replace(CPU, world_size=2, under_launcher=True)
    assert preflight.check(resolve(base_cfg, ctx=two, fsdp="full_shard auto_wrap")) == []
    with pytest.raises(ConfigError, match="fsdp: unknown option 'fullshard'"):
        preflight.check(resolve(base_cfg, fsdp="fullshard"), launch=False)


def test_the_plan_is_printed_and_serialised(base_cfg):
    p = resolve(base_cfg)
    text = p.describe()
    for name in ("packing", "attention", "loss_kernel", "zero_stage", "checkpointing", "precision"):
        assert name in text and name in p.to_dict()["decisions"]
    json.dumps(p.to_dict())


def _model_dir(tmp_path: Path, shape: dict) -> str:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **shape})
    )
    write_chatml_tokenizer(d)
    return str(d)


@pytest.mark.parametrize(
    "size, fields, gpus, memory",
    [
        ("7b", {"finetuning_type": "lora"}, 1, 24),
        ("7b", {"finetuning_type": "full", "bf16": True}, 8, 80),
        ("7b", {"finetuning_type": "full", "bf16": True}, 2, 80),
        ("0.5b", {"finetuning_type": "full", "bf16": True, "cutoff_len": 4096}, 1, 24),
        ("7b", {"finetuning_type": "full", "bf16": True, "deepspeed": "z3"}, 8, 40),
    ],
)
def test_every_recommended_yaml_change_is_accepted_by_check(
    base_cfg, qwen_shapes, tmp_path, monkeypatch, size, fields, gpus, memory
):
    from lmstack.train import preflight

    flat = {**base_cfg, "model_name_or_path": _model_dir(tmp_path, qwen_shapes[size]), **fields}
    monkeypatch.chdir(tmp_path)  # far from the checkout: shipped templates are found by name
    result = plan(request_from_plan(plan_for(build_config(flat), gpus, memory), gpus, memory, search=True))
    assert result.recommendation is not None
    changes = result.recommendation.yaml_changes
    new = {k: v for k, v in {**flat, **changes}.items() if v is not None}
    p = RunPlan.resolve(build_config(new), gpu_context(gpus, memory))
    preflight.check(p, launch=False)
    if "deepspeed" in changes and changes["deepspeed"]:
        assert (
            p.deepspeed is not None and p.zero_stage == result.recommendation.candidate.setup.deepspeed_stage
        )
    if changes.get("fsdp"):
        assert p.fsdp is not None and p.fsdp.source == "yaml"


def test_checkpointing_default_is_the_planners_call_and_explained(base_cfg, tmp_path):
    # LF recomputes always; lmstack's default `auto` recomputes only when the run would not fit
    p = resolve(base_cfg)
    assert p.checkpointing is False and "LLaMA-Factory always recomputes" in p.reasons["checkpointing"]
    gpu = resolve(base_cfg, gpu_context(1, 80))
    assert gpu.checkpointing is False and "fits without recompute" in gpu.reasons["checkpointing"]
    odd = tmp_path / "odd-model"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "not-a-known-architecture"}))
    fallback = resolve(base_cfg, gpu_context(1, 80), model_name_or_path=str(odd))
    assert fallback.checkpointing is True and "recomputing as LLaMA-Factory does" in fallback.reasons["auto"]
    with pytest.raises(ConfigError, match="auto needs a memory estimate"):  # asked for explicitly: no guess
        resolve(base_cfg, gpu_context(1, 80), model_name_or_path=str(odd), gradient_checkpointing="auto")


def test_a_configured_deepspeed_file_with_no_shipped_twin_is_kept_not_replaced_by_a_placeholder(
    base_cfg, qwen_shapes, tmp_path
):
    ds = tmp_path / "z3_opt_offload.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}))
    flat = {**base_cfg, "model_name_or_path": _model_dir(tmp_path, qwen_shapes["7b"]), "finetuning_type": "full",
            "bf16": True, "deepspeed": str(ds)}  # fmt: skip
    result = plan(request_from_plan(plan_for(build_config(flat), 8, 80), 8, 80, search=True))
    changes = result.recommendation.yaml_changes
    assert not str(changes.get("deepspeed", "")).startswith("<"), changes
