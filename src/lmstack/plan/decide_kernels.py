"""The kernel decisions of the run plan (split from plan/decide.py for size; decide.py re-exports them,
so `decide.<name>` stays the one namespace of decisions): Unsloth, the loss kernel, the LoRA kernel,
FP8 and regional compile. Each a small pure function returning (value, reason) or a frozen plan."""

from __future__ import annotations

from dataclasses import dataclass

from lmstack.config.errors import ConfigError
from lmstack.config.schema import Config
from lmstack.config.stages import StageSpec
from lmstack.launch.context import LaunchContext
from lmstack.plan.model_config import config_json as _config_json

Reasoned = tuple  # (value, reason)


LOGIT_LOSSES = ("use_dft_loss", "use_eaft_loss", "use_asft_loss")  # token weights from the whole distribution


UNSLOTH_STAGES = ("pt", "sft")  # the stages whose model lmstack loads through Unsloth (use_unsloth)


UNSLOTH_METHODS = ("lora", "full")  # LoRA / QLoRA and Unsloth's full_finetuning


def unsloth(cfg: Config, ctx: LaunchContext, dev: str, distributed: str | None) -> Reasoned:
    """Whether the model loads through Unsloth's FastLanguageModel (use_unsloth). `distributed` names
    the multi-process / sharded setup if any: Unsloth OSS is single-GPU, so there the run continues
    without it (the documented fallback, said once). What it cannot do at all
    (no CUDA, the package missing, a stage or method it has no path for) plan/rules.py refuses."""
    if not cfg.model.use_unsloth:
        return False, "use_unsloth: false"
    if distributed:
        return False, (
            f"use_unsloth: ignored, Unsloth OSS runs on one GPU and this run uses {distributed}; "
            "training continues with lmstack's own kernels"
        )
    if dev != "cuda":
        return False, "use_unsloth: needs a CUDA GPU"
    return (
        True,
        "use_unsloth: true, the model loads through Unsloth's FastLanguageModel (its kernels and LoRA)",
    )


def loss_kernel(
    spec: StageSpec,
    use_liger: bool,
    zero_stage: int | None,
    cfg: Config | None = None,
    use_unsloth: bool = False,
) -> Reasoned:
    """liger | chunked | none: how the training loss is computed."""
    if use_unsloth:
        return "none", "Unsloth's model forward computes its own fused cross-entropy"
    if not spec.fused_ce:
        return "none", f"stage {spec.name} needs the logits (its loss is not a plain token CE)"
    custom = [name for name in LOGIT_LOSSES if cfg is not None and getattr(cfg.finetuning, name)]
    if custom:
        return "none", f"{custom[0]} needs the logits (train/losses.py reweights each token's CE)"
    if use_liger:
        return "liger", "Liger's fused linear cross-entropy (no [tokens x vocab] logits)"
    if zero_stage == 3:
        # ZeRO-3 partitions the head weight and gathers it only inside the head module's own forward
        return "none", "ZeRO-3 partitions the output head; the model's own loss materialises the logits"
    return "chunked", "lmstack's chunked linear cross-entropy (no [tokens x vocab] logits)"


def lora_kernel_blockers(cfg: Config, zero_stage: int | None, fsdp: bool = False) -> list[str]:
    """What the fused LoRA Linear (models/fused_lora.py) needs that this config lacks (empty: it can run)."""
    ft = cfg.finetuning
    checks = [
        (ft.finetuning_type != "lora", f"finetuning_type: lora (got {ft.finetuning_type})"),
        (ft.use_dora, "use_dora: false (DoRA rescales the weight; PEFT computes it)"),
        (cfg.model.quantization_bit is not None, "no quantization_bit (the base is a quantized layer)"),
        (cfg.model.use_unsloth, "use_unsloth: false"),
        (zero_stage == 3, "no DeepSpeed ZeRO-3 (it gathers each weight inside its own module's forward)"),
        # measured on the H200: FSDP1 + fused LoRA failed at the first optimizer step (a dtype/device
        # mismatch in AdamW's foreach grouping) where PEFT's forward trains
        (fsdp, "no FSDP (it flattens and re-views the weights the fused function reads)"),
    ]
    return [need for failed, need in checks if failed]


def lora_kernel(cfg: Config, zero_stage: int | None, fsdp: bool = False) -> Reasoned:
    """fused | peft: how each LoRA Linear computes (lmstack's fused function or PEFT's own forward)."""
    choice = cfg.finetuning.lora_kernel
    if choice == "peft":
        return "peft", "lora_kernel: peft (PEFT's forward: separate scale and add kernels)"
    blockers = lora_kernel_blockers(cfg, zero_stage, fsdp)
    if choice == "fused":
        if blockers:
            raise ConfigError(
                f"lora_kernel: fused needs {'; '.join(blockers)}. Use lora_kernel: auto or peft"
            )
        return "fused", "lora_kernel: fused"
    if cfg.finetuning.finetuning_type != "lora":
        return "peft", f"finetuning_type: {cfg.finetuning.finetuning_type} trains no LoRA layers"
    if blockers:
        return "peft", f"lora_kernel: auto -> PEFT's forward; fused needs {blockers[0]}"
    return "fused", "lora_kernel: auto, fused LoRA Linear (scaling and add in the GEMM epilogue)"


FP8_KEPT_BF16 = ("the output head", "embeddings", "vision tower / projector", "dims not multiples of 16")


@dataclass(frozen=True)
class Fp8Plan:
    """plan.fp8: which GEMMs run in FP8 (models/fp8.py applies it; the planner reads it for memory)."""

    enabled: bool
    scope: str | None = None  # frozen-base (LoRA: base weights stored FP8) | float8-training (full: torchao)
    recipe: str | None = None  # rowwise | tensorwise (FSDP2 float8 all-gather supports tensorwise only)
    backend: str | None = None  # torch._scaled_mm (frozen-base) | torchao (float8-training)
    all_gather: bool = False  # FSDP2 gathers float8 weights
    kept_bf16: tuple[str, ...] = ()  # which Linear layers stay bf16
    reason: str = ""

    @property
    def base_weight_bytes(self) -> float | None:
        """Bytes a frozen base parameter takes in GPU memory under this plan (None: the load dtype's)."""
        return 1.0 if self.enabled and self.scope == "frozen-base" else None


def fp8(cfg: Config) -> Fp8Plan:
    """`fp8: true` -> what runs in FP8; the combinations it cannot run with are refused in plan/rules.py."""
    t, kind = cfg.training, cfg.finetuning.finetuning_type
    if not t.fp8:
        return Fp8Plan(False, reason="fp8: false")
    if kind == "lora":
        torchao = " (torchao's rowwise recipe; torchao has no FP8 layer for a frozen weight: lmstack's)"
        asked = f"fp8_backend: {t.fp8_backend}" + (torchao if t.fp8_backend == "torchao" else "")
        return Fp8Plan(
            True,
            "frozen-base",
            "rowwise",
            "torch._scaled_mm",
            kept_bf16=FP8_KEPT_BF16,
            reason=f"fp8: true, {asked}, LoRA: the frozen base weights stored in FP8 (1 byte a parameter), "
            "its forward and input-grad GEMMs in FP8 with row-wise scales (no weight-grad GEMM: it is frozen); "
            "adapters bf16",
        )
    gather = t.fp8_enable_fsdp_float8_all_gather
    recipe = "tensorwise" if gather else "rowwise"
    return Fp8Plan(
        True,
        "float8-training",
        recipe,
        "torchao",
        all_gather=gather,
        kept_bf16=FP8_KEPT_BF16,
        reason=f"fp8: true, fp8_backend: {t.fp8_backend}, {kind} fine-tuning: torchao's float8 training, "
        f"{recipe} recipe"
        + (" (FSDP2 float8 all-gather needs tensorwise scales)" if gather else "")
        + "; the master weights stay bf16/fp32",
    )


def fp8_small_layers(cfg: Config) -> str | None:
    """A note when FP8 leaves this model's projections in bf16 because they are too small to pay."""
    from lmstack.models.fp8 import small_layers_note

    return small_layers_note(_config_json(cfg) or {})


def fp8_speed_note(cfg: Config, fp8: Fp8Plan, compiled: CompilePlan) -> str | None:
    """The run plan's note for fp8: true on a trained base (float8-training): measured slower than bf16 when
    uncompiled, and no memory saved (plan/fp8_estimate.py FP8_FULL_*). It runs as asked: a note, not a
    refusal. None for LoRA, and where no projection converts (fp8_small_layers says so)."""
    if not (fp8.enabled and fp8.scope == "float8-training"):
        return None
    from lmstack.memory.fp8_estimate import float8_training_measured
    from lmstack.models.fp8 import paying_projections

    config = _config_json(cfg)
    if config and not paying_projections(config)[0]:
        return None
    tail = (
        "this run compiles each decoder layer (torch_compile: true), which torchao needs for speed; FP8's "
        "speed compiled is not measured"
        if compiled.enabled
        else "fp8: false runs faster here (uncompiled, as this run is)"
    )
    return (
        f"fp8 ({cfg.finetuning.finetuning_type} fine-tuning, torchao float8-training): expect it slower than "
        f"bf16, not faster: {float8_training_measured()}; {tail}"
    )


@dataclass(frozen=True)
class CompilePlan:
    """plan.compile: regional torch.compile (models/compile.py): each decoder layer on its own."""

    enabled: bool
    backend: str | None = None
    dynamic: bool | None = None  # False: fixed-size packed rows; None: torch decides after a recompile
    fullgraph: bool = False
    reason: str = ""


def compile_plan(cfg: Config, packed: bool, use_liger: bool, attn: str) -> CompilePlan:
    t = cfg.training
    if not t.torch_compile:
        return CompilePlan(False, reason="torch_compile: false")
    backend, dynamic = t.torch_compile_backend or "inductor", False if packed else None
    # one graph per layer: checked with SDPA, fused LoRA, FP8, checkpointing (not Liger, flex_attention)
    fullgraph = not use_liger and attn in ("sdpa", "eager")
    shapes = (
        "packed rows of one size: dynamic=False"
        if packed
        else "padded batches vary: dynamic after a recompile"
    )
    return CompilePlan(
        True,
        backend,
        dynamic,
        fullgraph,
        f"torch_compile: true -> regional: each decoder layer compiled ({backend}, {shapes}, "
        f"fullgraph={fullgraph}), one graph reused by every layer; not the whole model",
    )
