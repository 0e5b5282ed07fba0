"""The rules over the run plan's speed features: FP8 training (its combinations with quantization,
DeepSpeed, FSDP and adapters; the GPU and package it needs) and torch.compile. Part of the one rule table
of plan/rules.py (RULES / LAUNCH_RULES), which lists them; same contract: nothing, a note, or ConfigError."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmstack.config.errors import ConfigError

if TYPE_CHECKING:  # annotations only: the planner's request (plan/from_config.py) asks these rules too
    from lmstack.plan.runplan import RunPlan


FP8_GPU = "fp8: needs an NVIDIA GPU with FP8 tensor cores (sm89+: Ada, Hopper, Blackwell)"


def fp8_all_gather(plan: RunPlan) -> str | None:
    t = plan.cfg.training
    if not t.fp8_enable_fsdp_float8_all_gather:
        return None
    field = "fp8_enable_fsdp_float8_all_gather"
    if not t.fp8:
        raise ConfigError(
            f"{field}: only with fp8: true (FSDP2 gathers the weights of FP8 training); set fp8: true or remove it"
        )
    if plan.cfg.finetuning.finetuning_type != "full":
        raise ConfigError(
            f"{field}: gathers the float8 weights of full fine-tuning; with finetuning_type: "
            f"{plan.cfg.finetuning.finetuning_type} remove it"
        )
    if plan.fsdp is None or plan.fsdp.version != 2:
        got = "no FSDP" if plan.fsdp is None else f"FSDP{plan.fsdp.version}"
        raise ConfigError(
            f"{field}: needs FSDP2 (fsdp: 'full_shard auto_wrap' with fsdp_config: {{version: 2}}), this run has "
            f"{got}; switch to FSDP2 or remove it"
        )
    return None


def fp8_combinations(plan: RunPlan) -> str | None:
    cfg = plan.cfg
    if not cfg.training.fp8:
        return None
    ft, kind, bits = cfg.finetuning, cfg.finetuning.finetuning_type, cfg.model.quantization_bit
    ds = plan.deepspeed.ref if plan.deepspeed else None
    refusals = [
        (bits is not None, f"quantization_bit: {bits}: the frozen base is either bitsandbytes-quantized or FP8 "
         "(LLaMA-Factory refuses the pair too); remove one of them"),
        (ds is not None, f"deepspeed: {ds}: not verified with lmstack's FP8 layers (ZeRO partitions the weights "
         "they read); remove deepspeed (full fine-tuning can use fsdp) or fp8"),
        (kind in ("freeze", "oft"), f"finetuning_type: {kind} is not supported with fp8 (its frozen layers would "
         "need the FP8 frozen base and its trainable ones float8 training in one model); use lora or full"),
        (kind == "lora" and ft.use_dora, "use_dora: DoRA computes the norm of the base weight, which fp8 keeps "
         "in FP8; remove use_dora or fp8"),
        (kind == "lora" and plan.fsdp is not None, "LoRA under FSDP: lmstack does not shard the FP8 frozen base; "
         "train without fsdp (DDP on several GPUs) or remove fp8"),
        (plan.precision.compute != "bf16", "needs bf16: true (FP8 GEMMs take bf16 activations and return bf16; "
         f"this run computes in {plan.precision.compute}); set bf16: true"),
    ]  # fmt: skip
    problems = [why for failed, why in refusals if failed]
    if problems:
        raise ConfigError("fp8: " + "; ".join(problems))
    return None


def fp8_hardware(plan: RunPlan) -> str | None:
    if not plan.cfg.training.fp8:
        return None
    ctx = plan.ctx
    if plan.device != "cuda":
        has = "use_cpu: true runs on the CPU" if plan.cfg.training.use_cpu else "this machine has none"
        raise ConfigError(f"{FP8_GPU}; {has}; remove fp8 (or run on such a GPU)")
    cap = ctx.cuda_capability
    if cap is not None and cap < (8, 9):
        raise ConfigError(f"{FP8_GPU}; this machine has sm{cap[0]}{cap[1]} ({ctx.gpu_name}); remove fp8")
    return None


def fp8_torchao(plan: RunPlan) -> str | None:
    if plan.fp8.backend == "torchao" and not plan.ctx.has("torchao"):
        raise ConfigError(
            f"fp8: {plan.cfg.finetuning.finetuning_type} fine-tuning uses torchao's float8 training, and the "
            "torchao package is not installed: pip install 'lmstack[fp8]' (torchao >= 0.18 for torch >= 2.11)"
        )
    return None


def compile_fields(plan: RunPlan) -> str | None:
    t = plan.cfg.training
    if t.torch_compile and plan.stage.generates:
        raise ConfigError(
            f"torch_compile: stage {plan.stage.name} generates while it trains (a KV cache, lengths that change "
            "every step), which the compiled decoder layers would recompile for; remove torch_compile"
        )
    if t.torch_compile_backend and not t.torch_compile:
        return f"torch_compile_backend: {t.torch_compile_backend} has no effect without torch_compile: true"
    return None
