"""The individual run decisions, each a small pure function of (config, launch context, stage spec)
returning (value, reason). plan/runplan.py calls them once and freezes the results; nothing else
re-derives them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lmstack.config.errors import ConfigError
from lmstack.config.schema import Config
from lmstack.config.stages import StageSpec, stages_where
from lmstack.launch.context import LaunchContext

Reasoned = tuple  # (value, reason)


def device(cfg: Config, ctx: LaunchContext) -> Reasoned:
    if cfg.training.use_cpu:
        return "cpu", "use_cpu: true"
    return ("cuda", "a CUDA GPU is visible") if ctx.cuda else ("cpu", "no CUDA GPU visible")


@dataclass(frozen=True)
class Precision:
    compute: str  # bf16 | fp16 | fp32: the dtype the model computes in
    load: str  # dtype the weights are loaded in
    autocast: str | None  # bf16 | fp16 | None: the Trainer's mixed-precision switch
    master_weights: str  # model (fp32 weights under autocast or fp32 run) | optimizer (fp32 masters there)
    reason: str


def precision(
    cfg: Config, ctx: LaunchContext, dev: str, spec: StageSpec, zero_stage: int | None, fsdp: bool
) -> Precision:
    t, ft = cfg.training, cfg.finetuning
    if t.bf16 and t.fp16:
        raise ConfigError("bf16 and fp16: set only one of them")
    if t.fp16 and dev == "cpu":
        raise ConfigError(
            "fp16: needs a CUDA GPU (fp16 mixed precision does not run on CPU); use bf16: true, "
            "which runs on CPU through autocast, or no mixed precision"
        )
    if ft.pure_bf16 and t.fp16:
        raise ConfigError("pure_bf16 and fp16: pure_bf16 trains in bf16; remove fp16 (or pure_bf16)")
    if (t.bf16 or ft.pure_bf16) and dev == "cuda" and not ctx.bf16_supported:
        field = "pure_bf16" if ft.pure_bf16 else "bf16"
        raise ConfigError(f"{field}: this GPU has no bf16 support; use fp16: true")
    if ft.pure_bf16 and zero_stage == 3:
        raise ConfigError(
            "pure_bf16 and deepspeed ZeRO-3: not supported together (as in LLaMA-Factory); "
            "remove pure_bf16 (ZeRO-3 keeps bf16 weights with fp32 masters itself) or use ZeRO-2"
        )
    compute = "bf16" if (t.bf16 or ft.pure_bf16) else "fp16" if t.fp16 else "fp32"
    if ft.use_badam and compute == "fp32":  # LF: BAdam without bf16/fp16 keeps the checkpoint's dtype
        own = checkpoint_dtype(cfg)
        return Precision(
            own, own, None, "model", f"use_badam without bf16/fp16: the checkpoint's {own}, no autocast"
        )
    masters = master_weights(cfg, dev, spec, zero_stage, fsdp)
    keep_half = (
        ft.pure_bf16
        or ft.use_badam  # BAdam keeps weights in half precision, fp32 copies of one block only
        or (ft.finetuning_type in ("lora", "oft") and dev == "cuda")  # adapters: the frozen base stays half
        or masters == "optimizer"
    )
    load = compute if keep_half else "fp32"
    if ft.pure_bf16:
        return Precision("bf16", "bf16", None, "model", "pure_bf16: bf16 weights, no autocast, no fp32 copy")
    autocast = "bf16" if t.bf16 else "fp16" if t.fp16 else None
    reason = f"{autocast or 'no'} mixed precision, weights loaded in {load}"
    return Precision(compute, load, autocast, masters, reason)


CHECKPOINT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _config_json(cfg: Config) -> dict | None:
    """The model folder's config.json (None for a hub id or an unreadable file)."""
    try:
        return json.loads((Path(cfg.model.model_name_or_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None


def checkpoint_dtype(cfg: Config) -> str:
    """The dtype the model's config.json declares (fp32 when it names none)."""
    data = _config_json(cfg) or {}
    return CHECKPOINT_DTYPES.get(str(data.get("dtype") or data.get("torch_dtype") or "float32"), "fp32")


def master_weight_blockers(cfg: Config, spec: StageSpec, zero_stage: int | None, fsdp: bool) -> list[str]:
    """Why the optimizer-held master weights cannot be used for this config (empty: they can)."""
    ft, t = cfg.finetuning, cfg.training
    checks = [
        (not spec.master_weights, f"stage: {' or '.join(stages_where('master_weights'))}"),
        (not t.bf16, "bf16: true"),
        (ft.finetuning_type not in ("full", "freeze"), "finetuning_type: full or freeze"),
        (ft.pure_bf16, "pure_bf16: false (pure_bf16 keeps no fp32 master at all)"),
        (zero_stage is not None, "no deepspeed (DeepSpeed keeps its own fp32 master weights)"),
        (fsdp, "no FSDP (FSDP's MixedPrecision keeps its own fp32 master weights)"),
        (cfg.model.quantization_bit is not None, "no quantization_bit"),
        (
            ft.use_galore or ft.use_apollo or ft.use_badam or ft.use_muon or ft.use_adam_mini,
            "the default AdamW optimizer (not GaLore/APOLLO/BAdam/Muon/Adam-mini)",
        ),
        (t.gradient_accumulation_steps != 1, "gradient_accumulation_steps: 1"),
        (t.optim not in ("adamw_torch", "adamw_torch_fused"), "optim: adamw_torch or adamw_torch_fused"),
    ]
    return [need for failed, need in checks if failed]


def master_weights(cfg: Config, dev: str, spec: StageSpec, zero_stage: int | None, fsdp: bool) -> str:
    """'optimizer' or 'model'; an explicit `optimizer` that cannot apply is an error."""
    choice = cfg.training.master_weights
    if choice == "model":
        return "model"
    blockers = master_weight_blockers(cfg, spec, zero_stage, fsdp)
    if choice == "optimizer":
        if blockers:
            raise ConfigError(
                f"master_weights: optimizer needs {'; '.join(blockers)}. Use master_weights: model "
                "(classic AMP) or auto"
            )
        return "optimizer"
    return "optimizer" if dev == "cuda" and not blockers else "model"


def packing(cfg: Config, spec: StageSpec) -> Reasoned:
    d = cfg.data
    if d.neat_packing or d.packing:
        field = "packing" if d.packing else "neat_packing"
        if not spec.packs:
            raise ConfigError(
                f"{field}: supported for stage {' and '.join(stages_where('packs'))}, not {spec.name}; remove it"
            )
        if d.streaming:
            raise ConfigError(
                f"{field}: not supported with streaming: true yet (rows are packed from the whole "
                "tokenized set); set streaming: false or packing: false"
            )
        return True, f"{field}: true"
    if cfg.training.max_tokens_per_batch is not None and not (
        d.packing or (d.packing is None and spec.packs_by_default)
    ):
        raise ConfigError(
            "max_tokens_per_batch: needs packing: true (the token budget is filled by packing samples "
            "into rows); set packing: true or remove max_tokens_per_batch"
        )
    if d.packing is None and spec.packs_by_default:
        if d.streaming:
            return False, f"stage {spec.name} packs by default, but streaming: true reads texts one by one"
        return (
            True,
            f"stage {spec.name} packs by default (LLaMA-Factory's default; packing: false to turn off)",
        )
    return False, "packing: false" if d.packing is False else "packing unset"


def row_capacity(cfg: Config, micro_batch: int | str) -> int:
    """Tokens per packed row: cutoff_len, or max_tokens_per_batch split over the micro-batch rows."""
    cutoff, budget = cfg.data.cutoff_len, cfg.training.max_tokens_per_batch
    if budget is None:
        return cutoff
    if micro_batch == "auto":
        raise ConfigError(
            "per_device_train_batch_size: auto cannot be combined with max_tokens_per_batch (the "
            "token budget already sets the rows); set one of them"
        )
    capacity = budget // micro_batch
    if capacity < cutoff:
        raise ConfigError(
            f"max_tokens_per_batch: {budget} tokens over per_device_train_batch_size: {micro_batch} rows gives "
            f"{capacity}-token rows, shorter than cutoff_len: {cutoff}; raise max_tokens_per_batch to at "
            f"least {cutoff * micro_batch} or lower per_device_train_batch_size"
        )
    return capacity


ATTN_IMPL = {
    "disabled": "eager",
    "sdpa": "sdpa",
    "fa2": "flash_attention_2",
    "fa3": "flash_attention_3",
    "flex": "flex_attention",
}


def attention(cfg: Config, ctx: LaunchContext, dev: str, packed: bool) -> Reasoned:
    """`flash_attn` -> transformers' attn_implementation; `auto` picks the best available."""
    choice = cfg.model.flash_attn
    if choice in ("fa2", "fa3"):
        package = "flash_attn" if choice == "fa2" else "flash_attn_interface"
        if dev != "cuda" or not ctx.has(package):
            raise ConfigError(
                f"flash_attn: {choice} needs a CUDA GPU and the `{package}` package "
                f"(pip install flash-attn); use flash_attn: sdpa or auto instead"
            )
    if choice != "auto":
        return ATTN_IMPL[choice], f"flash_attn: {choice}"
    if dev == "cuda" and ctx.has("flash_attn"):
        return "flash_attention_2", "flash_attn: auto, flash-attn is installed (varlen on packed rows)"
    if dev == "cuda" and packed:
        # flex_attention's document-causal BlockMask skips the masked blocks (3.7x SDPA on a packed row)
        return "flex_attention", "flash_attn: auto, packed rows on a GPU: flex_attention document mask"
    return "sdpa", "flash_attn: auto, " + ("flash-attn not installed" if dev == "cuda" else "CPU")


def liger(cfg: Config, ctx: LaunchContext, dev: str) -> Reasoned:
    """Whether Liger's kernels are applied; a documented fallback (said once) when they cannot be."""
    if not cfg.model.enable_liger_kernel:
        return False, "enable_liger_kernel: false"
    if dev != "cuda":
        return False, (
            f"enable_liger_kernel: Liger's Triton kernels need a CUDA GPU; this {dev} run continues without them"
        )
    if not ctx.has("liger_kernel"):
        return False, (
            "enable_liger_kernel: the liger-kernel package is not installed (pip install liger-kernel); "
            "training continues without Liger's kernels"
        )
    model_type = _model_type(cfg)
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:  # planning for another machine (`lmstack plan --gpus N` on a CPU box)
        return True, "enable_liger_kernel: assumed available on the target GPU machine"
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return False, (
            f"enable_liger_kernel: Liger has no kernels for model type {model_type!r}; training continues "
            "without them"
        )
    return True, f"enable_liger_kernel: Liger kernels for {model_type}"


def _model_type(cfg: Config) -> str | None:
    data = _config_json(cfg)
    if data is not None:
        return data.get("model_type")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(cfg.model.model_name_or_path).model_type


LOGIT_LOSSES = ("use_dft_loss", "use_eaft_loss", "use_asft_loss")  # token weights from the whole distribution


UNSLOTH_STAGES = ("pt", "sft")  # the stages whose model lmstack loads through Unsloth (use_unsloth)
UNSLOTH_METHODS = ("lora", "full")  # LoRA / QLoRA and Unsloth's full_finetuning


def unsloth(cfg: Config, ctx: LaunchContext, dev: str, distributed: str | None) -> Reasoned:
    """Whether the model loads through Unsloth's FastLanguageModel (use_unsloth). `distributed` names
    the multi-process / sharded setup if any: Unsloth OSS is single-GPU, so there the run continues
    without it (seed 003 10.4 / 10.7: the documented fallback, said once). What it cannot do at all
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


def checkpointing(cfg: Config, user_value: bool | str) -> Reasoned:
    """`user_value` is what the YAML said (auto already replaced by the planner in cfg)."""
    if cfg.model.use_unsloth_gc:  # LF: use_unsloth_gc is a checkpointing mode, it turns checkpointing on
        off = [
            f for f, on in (("gradient_checkpointing: false", user_value is False),
                            ("disable_gradient_checkpointing: true", cfg.model.disable_gradient_checkpointing))
            if on
        ]  # fmt: skip
        if off:
            raise ConfigError(
                f"use_unsloth_gc: true and {' and '.join(off)}: use_unsloth_gc is offloaded gradient "
                "checkpointing (every layer recomputed, its input parked in CPU RAM); remove one of them"
            )
        return True, "use_unsloth_gc: true (checkpointing with the layer inputs offloaded to CPU RAM)"
    if cfg.model.disable_gradient_checkpointing:
        return False, "disable_gradient_checkpointing: true"
    gc = cfg.training.gradient_checkpointing
    if user_value == "auto":
        why = "gradient_checkpointing: auto (the default; LLaMA-Factory always recomputes, lmstack only when "
        if gc == "auto":
            return (
                False,
                why + "the planner finds the run does not fit without; it decides when training starts)",
            )
        return bool(gc), why + "needed) -> " + ("recompute to fit" if gc else "fits without recompute")
    return bool(gc), f"gradient_checkpointing: {str(gc).lower()}"


def checkpoint_offload(cfg: Config, zero_stage: int | None, fsdp: bool) -> Reasoned:
    """Whether the checkpointed layer inputs wait in CPU RAM (use_unsloth_gc; models/offload_ckpt.py).
    It composes with DDP and ZeRO-1/2 (whole layers on every rank); under ZeRO-3/FSDP the recompute
    gathers sharded weights inside hooks that lmstack has not tested with the offload, so it is refused."""
    if not cfg.model.use_unsloth_gc:
        return False, "use_unsloth_gc: false"
    if zero_stage == 3 or fsdp:
        what = "DeepSpeed ZeRO-3" if zero_stage == 3 else "FSDP"
        raise ConfigError(
            f"use_unsloth_gc: true with {what}: offloaded checkpointing runs with DDP or ZeRO-1/2 only "
            f"(untested with sharded weights); remove use_unsloth_gc (plain gradient_checkpointing: true "
            f"works with {what}) or use ZeRO-2"
        )
    return (
        True,
        "use_unsloth_gc: true, each layer's input hidden state waits in (pinned) CPU RAM until its backward",
    )


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
