"""`fp8` as a run-plan decision (plan.fp8) and its refusals by name, before anything loads; the LF fields
fp8 / fp8_backend / fp8_enable_fsdp_float8_all_gather with LF's names and defaults."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config
from lmstack.launch.context import LaunchContext
from lmstack.plan.rules import check_rules
from lmstack.plan.runplan import RunPlan

REPO = Path(__file__).resolve().parents[3]
CPU = LaunchContext()
H200 = LaunchContext(
    cuda=True,
    gpu_count=1,
    gpu_memory_gib=139.8,
    bf16_supported=True,
    cuda_capability=(9, 0),
    gpu_name="NVIDIA H200",
    packages=frozenset({"torchao"}),
)
A100 = replace(H200, cuda_capability=(8, 0), gpu_name="NVIDIA A100-SXM4-80GB")
FSDP2 = {"fsdp": "full_shard auto_wrap", "fsdp_config": {"version": 2}}


def plan_of(base_cfg, ctx=H200, **over) -> RunPlan:
    return RunPlan.resolve(build_config({**base_cfg, "bf16": True, "fp8": True, **over}), ctx)


def problems(base_cfg, ctx=H200, launch=True, **over) -> list[str]:
    return check_rules(plan_of(base_cfg, ctx, **over), launch)[1]


def multi_gpu(ctx: LaunchContext) -> LaunchContext:
    return replace(ctx, gpu_count=2, world_size=2, under_launcher=True)


def test_lf_defaults_and_names():
    cfg = build_config({"model_name_or_path": "m", "output_dir": "o"})
    t = cfg.training
    assert (t.fp8, t.fp8_backend, t.fp8_enable_fsdp_float8_all_gather, t.torch_compile_backend) == (
        False,
        "auto",
        False,
        None,
    )


@pytest.mark.parametrize("backend,name", [("te", "Transformer Engine"), ("msamp", "MS-AMP")])
def test_lf_backends_lmstack_lacks_are_refused_by_name(backend, name):
    with pytest.raises(ConfigError) as err:
        build_config({"model_name_or_path": "m", "output_dir": "o", "fp8_backend": backend})
    assert str(err.value).startswith(f"fp8_backend: got '{backend}'; {backend} ({name}")
    assert "use fp8_backend: auto or torchao" in str(err.value)


def test_lora_plan_is_the_fp8_frozen_base(base_cfg):
    plan = plan_of(base_cfg)
    f = plan.fp8
    assert (f.enabled, f.scope, f.recipe, f.backend) == (True, "frozen-base", "rowwise", "torch._scaled_mm")
    assert "the output head" in f.kept_bf16 and "dims not multiples of 16" in f.kept_bf16
    assert f.base_weight_bytes == 1.0  # the planner's hook: frozen base weights take 1 byte
    assert plan.decisions()["fp8"] == "frozen-base (rowwise)"
    assert "forward and input-grad GEMMs in FP8" in plan.reasons["fp8"]
    assert problems(base_cfg) == []
    spec = plan.speedup_spec()
    assert (spec.fp8_scope, spec.fp8_recipe, spec.device, spec.compile_backend) == (
        "frozen-base",
        "rowwise",
        "cuda:0",
        None,
    )


def test_the_plan_notes_projections_too_small_for_fp8(base_cfg, tmp_path):
    from lmstack.models.fp8 import small_layers_note

    notes = plan_of(base_cfg).notes  # the tiny model: nothing is large enough
    assert any(
        n.startswith("fp8: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj stay bf16")
        for n in notes
    )
    assert any("no projection is FP8, the run computes in bf16" in n for n in notes)
    qwen7b = {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
    }
    assert small_layers_note(qwen7b) == (
        "fp8: k_proj, v_proj stay bf16: too small for FP8 to pay (hidden_size 3584, intermediate_size 18944; "
        "models/fp8.py too_small)"
    )
    qwen05b = {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
    }
    assert small_layers_note(qwen05b).endswith("no projection is FP8, the run computes in bf16")


def test_full_plan_is_torchao_float8_training(base_cfg):
    plan = plan_of(base_cfg, finetuning_type="full")
    assert (plan.fp8.scope, plan.fp8.recipe, plan.fp8.backend) == ("float8-training", "rowwise", "torchao")
    assert plan.fp8.base_weight_bytes is None
    assert problems(base_cfg, finetuning_type="full") == []


def test_fp8_off_is_off(base_cfg):
    plan = RunPlan.resolve(build_config(base_cfg), H200)
    assert not plan.fp8.enabled and plan.decisions()["fp8"] is False and plan.speedup_spec().fp8_scope is None


def test_no_gpu_is_refused_by_name(base_cfg):
    found = problems(base_cfg, CPU)
    assert found == [
        "fp8: needs an NVIDIA GPU with FP8 tensor cores (sm89+: Ada, Hopper, Blackwell); this machine has "
        "none; remove fp8 (or run on such a GPU)"
    ]
    found = problems(base_cfg, H200, use_cpu=True)
    assert len(found) == 1 and "use_cpu: true runs on the CPU" in found[0]


def test_a_gpu_without_fp8_tensor_cores_is_refused_naming_it(base_cfg):
    found = problems(base_cfg, A100)
    assert found == [
        "fp8: needs an NVIDIA GPU with FP8 tensor cores (sm89+: Ada, Hopper, Blackwell); this machine has "
        "sm80 (NVIDIA A100-SXM4-80GB); remove fp8"
    ]
    assert problems(base_cfg, replace(H200, cuda_capability=(8, 9))) == []  # Ada


def test_machine_rules_are_left_to_the_launch(base_cfg):
    assert problems(base_cfg, CPU, launch=False) == []  # `lmstack check` may run on another machine


def test_full_without_torchao_names_the_extra(base_cfg):
    bare = replace(H200, packages=frozenset())
    found = problems(base_cfg, bare, finetuning_type="full")
    assert len(found) == 1 and "torchao package is not installed: pip install 'lmstack[fp8]'" in found[0]
    assert problems(base_cfg, bare) == []  # LoRA's FP8 base needs torch only


@pytest.mark.parametrize(
    "over,words",
    [
        (
            {"quantization_bit": 4},
            "quantization_bit: 4: the frozen base is either bitsandbytes-quantized or FP8",
        ),
        (
            {"deepspeed": str(REPO / "examples/deepspeed/ds_z2_config.json")},
            "ds_z2_config.json: not verified",
        ),
        ({"finetuning_type": "freeze"}, "finetuning_type: freeze is not supported with fp8"),
        ({"use_dora": True}, "use_dora: DoRA computes the norm of the base weight"),
        ({"bf16": False}, "needs bf16: true (FP8 GEMMs take bf16 activations"),
    ],
)
def test_combinations_fp8_cannot_run_are_refused_by_name(base_cfg, over, words):
    found = problems(base_cfg, launch=False, **over)
    assert len(found) == 1 and found[0].startswith("fp8: ") and words in found[0]


def test_lora_under_fsdp_is_refused(base_cfg):
    found = problems(base_cfg, multi_gpu(H200), launch=False, **FSDP2)
    assert len(found) == 1 and "LoRA under FSDP: lmstack does not shard the FP8 frozen base" in found[0]


def test_float8_all_gather_needs_fp8_fsdp2_and_full(base_cfg):
    field = "fp8_enable_fsdp_float8_all_gather"
    two = multi_gpu(H200)
    found = problems(base_cfg, two, launch=False, fp8=False, finetuning_type="full", **{field: True}, **FSDP2)
    assert found == [
        f"{field}: only with fp8: true (FSDP2 gathers the weights of FP8 training); set fp8: true or remove it"
    ]
    found = problems(base_cfg, two, launch=False, finetuning_type="full", **{field: True})
    assert len(found) == 1 and f"{field}: needs FSDP2" in found[0] and "this run has no FSDP" in found[0]
    fsdp1 = {"fsdp": "full_shard auto_wrap"}
    found = problems(base_cfg, two, launch=False, finetuning_type="full", **{field: True}, **fsdp1)
    assert len(found) == 1 and "this run has FSDP1" in found[0]
    found = problems(base_cfg, two, launch=False, **{field: True})
    assert any(f"{field}: gathers the float8 weights of full fine-tuning" in p for p in found)
    plan = plan_of(base_cfg, two, finetuning_type="full", **{field: True}, **FSDP2)
    assert check_rules(plan, launch=False)[1] == []
    assert (plan.fp8.recipe, plan.fp8.all_gather) == ("tensorwise", True)  # torchao: tensorwise only
    assert plan.speedup_spec().fp8_all_gather


def test_refusals_stop_the_run_before_the_model_loads(base_cfg, tmp_path):
    from lmstack.train.run import train

    with pytest.raises(ConfigError, match="fp8: needs an NVIDIA GPU with FP8 tensor cores"):
        train(None, {**base_cfg, "bf16": True, "fp8": True, "output_dir": str(tmp_path / "o")})
    assert not (tmp_path / "o").exists()
