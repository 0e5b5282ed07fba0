"""The individual run decisions, each a small pure function of (config, launch context, stage spec)
returning (value, reason). plan/runplan.py calls them once and freezes the results; nothing else
re-derives them."""

from __future__ import annotations

from dataclasses import dataclass

from lmstack.config.errors import ConfigError
from lmstack.config.schema import ADAMW_OPTIMS, Config
from lmstack.config.stages import StageSpec, stages_where
from lmstack.launch.context import LaunchContext
from lmstack.plan.model_config import config_json as _config_json

Reasoned = tuple  # (value, reason)


def device(cfg: Config, ctx: LaunchContext) -> Reasoned:
    if cfg.training.use_cpu:
        return "cpu", "use_cpu: true"
    if ctx.cuda and ctx.planned_for:  # lmstack plan for another machine: this one's GPU is not looked at
        return "cuda", ctx.planned_for
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
        (t.optim not in ADAMW_OPTIMS, f"optim: {' or '.join(ADAMW_OPTIMS)}"),
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
                "checkpointing (the recomputed layers' inputs parked in CPU RAM); remove one of them"
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


EXPANDABLE_SEGMENTS = "expandable_segments:True"


@dataclass(frozen=True)
class AllocatorPlan:
    """plan.allocator: the CUDA caching allocator's mode. `setting` is what lmstack applies before the model
    loads (train/run.py) and hands to its torchrun workers' environment (launch/torchrun.py); None applies
    nothing (the default allocator, the user's own PYTORCH_ALLOC_CONF, or no CUDA)."""

    expandable: bool  # segments grow in place (expandable_segments): no fragmentation from changing shapes
    setting: str | None = None
    source: str = "plan"  # plan | environment | none (no CUDA)
    reason: str = ""

    @property
    def label(self) -> str | None:
        if self.source == "none":
            return None
        return "expandable_segments" if self.expandable else "default"


def allocator(
    cfg: Config, ctx: LaunchContext, dev: str, spec: StageSpec, packed: bool, sharded: bool
) -> AllocatorPlan:
    """Expandable segments when the run's allocations change size from step to step (measured on the H200:
    padded rows reserved 1.74x what they allocated, image rows 2.7x; packed rows 1.02-1.04x); the default
    allocator otherwise. The user's own allocator variable wins. Known incompatibilities keep it off:
    CUDA graphs (their private pools; a reported hang: pytorch/torchtitan#3306) and NCCL's buffer
    registration of allocator segments (fails on cuMem-mapped memory: NVIDIA/nccl#2332). CUDA IPC
    (pytorch/pytorch#165685) does not apply: no lmstack training path shares CUDA tensors between
    processes; DeepSpeed and plain NCCL collectives have no known incompatibility."""
    if dev != "cuda":
        env = ctx.alloc_conf
        unused = f" ({env[0]}={env[1]} in the environment has no effect here)" if env else ""
        return AllocatorPlan(False, source="none", reason=f"{dev}: no CUDA caching allocator to set{unused}")
    why = variable_shapes(cfg, spec, packed, sharded)
    blocked = allocator_blocker(cfg, ctx) if why else None
    want = bool(why) and blocked is None
    reason = (
        f"default allocator: {why}, but {blocked}"
        if blocked
        else f"expandable segments: {why}"
        if why
        else "default allocator: packed rows of one shape (reserved 1.02-1.04x allocated on the H200)"
    )
    if ctx.alloc_conf is not None:
        name, value = ctx.alloc_conf
        on = expandable_in(value)
        verdict = "as the plan would choose" if on == want else "the plan would choose otherwise"
        return AllocatorPlan(
            on, None, "environment", f"{name}={value} in the environment kept ({verdict}: {reason})"
        )
    return AllocatorPlan(want, EXPANDABLE_SEGMENTS if want else None, "plan", reason)


def expandable_in(value: str) -> bool:
    """Whether an allocator setting string (`key:value,...`, torch's format) turns expandable segments on."""
    pairs = dict(item.split(":", 1) for item in value.replace(" ", "").split(",") if ":" in item)
    return pairs.get("expandable_segments") == "True" and pairs.get("backend", "native") == "native"


def variable_shapes(cfg: Config, spec: StageSpec, packed: bool, sharded: bool) -> str | None:
    """Why this run's GPU allocations change size from step to step (None: one batch shape throughout)."""
    from lmstack.models.vision import vision_model_type

    t, d = cfg.training, cfg.data
    if spec.generates:
        return f"stage {spec.name} generates (KV caches and completions change length)"
    if not packed:
        rows = {"pairwise": "chosen/rejected pairs", "kto": "KTO rows and their KL batch"}.get(
            spec.data, "rows"
        )
        return f"{rows} padded to each batch's longest (not packed): batches change width"
    if vision_model_type(cfg.model.model_name_or_path):
        return "image rows: the pixel tensors change size from batch to batch"
    evaluates = bool(d.val_size or d.eval_dataset) and (t.do_eval or t.eval_strategy != "no")
    if evaluates and t.per_device_eval_batch_size != t.per_device_train_batch_size:
        return (
            f"evaluation batches of {t.per_device_eval_batch_size} rows between training batches of "
            f"{t.per_device_train_batch_size}"
        )
    if t.do_predict:
        return "do_predict generates (KV caches change length)"
    if sharded:
        return "ZeRO-3/FSDP gathers each layer's weights into buffers of changing size"
    return None


def allocator_blocker(cfg: Config, ctx: LaunchContext) -> str | None:
    """A known incompatibility of expandable segments with this run (None: none applies)."""
    if cfg.training.torch_compile and cfg.training.torch_compile_backend == "cudagraphs":
        return (
            "torch_compile_backend: cudagraphs captures into private memory pools that expandable segments "
            "do not serve (and hangs were reported with both: pytorch/torchtitan#3306)"
        )
    if ctx.nccl_register_hook:
        return (
            "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK registers allocator segments with NCCL, which "
            "fails on expandable (cuMem-mapped) segments (NVIDIA/nccl#2332)"
        )
    return None
