"""Megatron-LM 3D layouts (TP x PP x DP): validity rules, bubble, per-GPU memory, arguments.

Rules (Megatron-core's):
* TP x PP x DP = total GPUs.
* TP divides num_attention_heads (each rank holds whole heads).
* TP divides num_key_value_heads: Megatron-core splits query groups with ``divide(num_query_groups,
  tp)``, which asserts exact divisibility -- unlike vLLM it does not replicate KV heads when
  TP > KV heads, so TP=16 on a model with 8 KV heads is rejected.
* PP divides num_layers (uneven first/last stages need extra flags we do not emit).
* TP <= GPUs per node (TP all-reduces every layer: it needs NVLink, not the network).
Memory follows Megatron's bytes/param table and Korthikanti et al. 2022 (REFERENCE 7.2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmstack.memory import memory as mem
from lmstack.memory.model_spec import ModelSpec

# Megatron mixed precision (bf16 params, fp32 main grads, fp32 master + Adam m/v):
# 18 B/param; --use-distributed-optimizer shards the 12 optimizer bytes over DP: 6 + 12/DP.
MEGATRON_WEIGHT_BYTES = 2
MEGATRON_GRAD_BYTES = 4
MEGATRON_OPTIM_BYTES = 12
# Korthikanti Table 2 constants (16-bit activations, GPT block with 4h MLP).
KORTHIKANTI_LAYER = 34  # 11 attention + 19 MLP + 4 LayerNorm inputs, x s*b*h
KORTHIKANTI_TP_REPLICATED = 10  # part not split by TP without sequence parallelism
KORTHIKANTI_TP_SPLIT = 24
KORTHIKANTI_SCORES = 5  # x a*s/h: scores, softmax, dropout mask
FULL_RECOMPUTE_BYTES = 2  # x s*b*h: only the layer input is kept
OUTPUT_LAYER_BYTES = 4  # x s*b*V/t: fp32 logits on the last stage (Korthikanti §4.2)
BUBBLE_WARN_FACTOR = 4  # micro batches > 4 x PP keep the 1F1B bubble under ~20%
RECOMPUTE_CHOICES = (None, "selective", "full")
# the families lmstack's own Megatron backend runs (models/megatron_weights.py): it splits their vocabulary
# exactly, where Megatron-LM pads it, so for them TP must divide vocab_size too
MEGATRON_BACKEND_FAMILIES = ("qwen2", "qwen3", "llama")


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    valid: bool
    reason: str
    bubble_ratio: float
    micro_batches: int
    micro_batch_size: int
    sequence_parallel: bool
    distributed_optimizer: bool
    recompute: str | None
    per_gpu: mem.MemoryBreakdown | None = None
    fits: bool = False
    warnings: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, object]:
        return {
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "valid": self.valid,
            "reason": self.reason,
            "bubble_ratio": round(self.bubble_ratio, 4),
            "fits": self.fits,
            "warnings": list(self.warnings),
            "per_gpu_gib": self.per_gpu.to_dict() if self.per_gpu else None,
        }


def layout_errors(
    spec: ModelSpec, gpus: int, tp: int, pp: int, gpus_per_node: int, interconnect: str | None = None
) -> list[str]:
    """Every rule a TP/PP pair breaks, each naming the rule and the fix. `interconnect`: the GPUs'
    ("pcie": no NVLink between them, so no TP; None or "nvlink": TP inside a node)."""
    errs: list[str] = []
    if tp < 1 or pp < 1:
        return [f"tp={tp}, pp={pp}: sizes must be >= 1"]
    if gpus % (tp * pp):
        errs.append(
            f"TP x PP = {tp * pp} does not divide the {gpus} GPUs (TP x PP x DP must equal total GPUs)"
        )
    if spec.num_heads % tp:
        errs.append(f"TP={tp} does not divide num_attention_heads={spec.num_heads}")
    if spec.num_kv_heads % tp:
        errs.append(
            f"TP={tp} does not divide num_key_value_heads={spec.num_kv_heads} "
            "(Megatron splits KV groups exactly; it does not replicate them)"
        )
    if spec.model_type in MEGATRON_BACKEND_FAMILIES and spec.vocab_size % tp:
        errs.append(
            f"TP={tp} does not divide vocab_size={spec.vocab_size} (lmstack's Megatron backend splits the "
            "vocabulary exactly; it does not pad it)"
        )
    if spec.num_layers % pp:
        errs.append(f"PP={pp} does not divide num_layers={spec.num_layers}")
    if tp > gpus_per_node:
        errs.append(f"TP={tp} exceeds gpus_per_node={gpus_per_node} (TP must stay inside one NVLink node)")
    if tp > 1 and interconnect == "pcie":
        errs.append(
            f"TP={tp} on GPUs linked by PCIe only (TP all-reduces every layer's activations and needs "
            "NVLink); use TP=1 with PP/DP"
        )
    return errs


def bubble_ratio(pp: int, micro_batches: int) -> float:
    """Pipeline bubble of the 1F1B schedule: (PP - 1) / micro_batches."""
    return (pp - 1) / max(micro_batches, 1)


def korthikanti_layer_bytes(
    s: int, b: int, h: int, a: int, t: int, sequence_parallel: bool, recompute: str | None, flash: bool
) -> float:
    """Activation bytes per transformer layer (Korthikanti et al. 2022, Table 2)."""
    if recompute == "full":
        return FULL_RECOMPUTE_BYTES * s * b * h / (t if sequence_parallel else 1)
    scores = 0.0 if (flash or recompute == "selective") else KORTHIKANTI_SCORES * a * s / h
    if sequence_parallel or t == 1:
        return s * b * h / t * (KORTHIKANTI_LAYER + scores)
    return s * b * h * (KORTHIKANTI_TP_REPLICATED + KORTHIKANTI_TP_SPLIT / t + scores / t)


def megatron_memory(
    spec: ModelSpec,
    tp: int,
    pp: int,
    dp: int,
    *,
    micro_batch_size: int,
    micro_batches: int,
    seq_len: int,
    sequence_parallel: bool,
    distributed_optimizer: bool,
    recompute: str | None,
    flash: bool = True,
) -> mem.MemoryBreakdown:
    """Per-GPU memory of the most loaded pipeline stage (first or last) under Megatron."""
    layers_per_stage = spec.num_layers // pp
    body = layers_per_stage * spec.layer_params / tp
    first = body + spec.embed_params / tp + (spec.lm_head_params / tp if pp == 1 else 0)
    last = body + (spec.lm_head_params or spec.embed_params) / tp  # tied head is a copy on the last stage
    params = max(first, last)
    optim_div = dp if distributed_optimizer else 1
    layer = korthikanti_layer_bytes(
        seq_len, micro_batch_size, spec.hidden_size, spec.num_heads, tp, sequence_parallel, recompute, flash
    )
    in_flight = min(pp, micro_batches)  # 1F1B: the first stage holds PP micro-batches
    acts = layer * layers_per_stage * in_flight
    logits = OUTPUT_LAYER_BYTES * seq_len * micro_batch_size * spec.vocab_size / tp
    return mem.breakdown(
        MEGATRON_WEIGHT_BYTES * params,
        MEGATRON_GRAD_BYTES * params,
        MEGATRON_OPTIM_BYTES * params / optim_div,
        acts,
        logits,
    )


def check_layout(
    spec: ModelSpec,
    gpus: int,
    tp: int,
    pp: int,
    *,
    gpus_per_node: int = 8,
    micro_batches: int = 32,
    micro_batch_size: int = 1,
    seq_len: int = 2048,
    gpu_memory_gib: float = 80.0,
    sequence_parallel: bool | None = None,
    distributed_optimizer: bool = True,
    recompute: str | None = "selective",
    interconnect: str | None = None,
) -> Layout:
    """Explain whether one TP/PP layout is valid, how big its bubble is and whether it fits."""
    if recompute not in RECOMPUTE_CHOICES:
        raise ValueError(f"recompute: got {recompute!r}; allowed: selective | full | null")
    errs = layout_errors(spec, gpus, tp, pp, gpus_per_node, interconnect)
    sp = tp > 1 if sequence_parallel is None else (sequence_parallel and tp > 1)
    dp = gpus // (tp * pp) if tp * pp and gpus % (tp * pp) == 0 else 0
    bubble = bubble_ratio(pp, micro_batches)
    warns: list[str] = []
    if pp > 1 and micro_batches < BUBBLE_WARN_FACTOR * pp:
        warns.append(
            f"micro_batches={micro_batches} < {BUBBLE_WARN_FACTOR} x PP={BUBBLE_WARN_FACTOR * pp}: "
            f"bubble {bubble:.0%}; raise the global batch or lower PP"
        )
    per_gpu = None
    fits = False
    if not errs:
        per_gpu = megatron_memory(
            spec, tp, pp, dp, micro_batch_size=micro_batch_size, micro_batches=micro_batches,
            seq_len=seq_len, sequence_parallel=sp, distributed_optimizer=distributed_optimizer,
            recompute=recompute,
        )  # fmt: skip
        fits = per_gpu.total <= gpu_memory_gib * mem.SAFETY_MARGIN
    reason = "; ".join(errs) if errs else f"valid: TP={tp} x PP={pp} x DP={dp} = {gpus} GPUs"
    return Layout(
        tp, pp, dp, not errs, reason, bubble, micro_batches, micro_batch_size, sp,
        distributed_optimizer, recompute, per_gpu, fits, tuple(warns),
    )  # fmt: skip


def _rank_key(layout: Layout) -> tuple[object, ...]:
    """Valid first, then fitting, then the smallest TP x PP, then the lowest bubble, lower TP."""
    return (not layout.valid, not layout.fits, layout.tp * layout.pp, layout.bubble_ratio, layout.tp)


def enumerate_layouts(
    spec: ModelSpec,
    gpus: int,
    gpus_per_node: int,
    micro_batches: int,
    **options: object,
) -> list[Layout]:
    """Every TP x PP x DP = gpus layout (valid or not, with reasons), best first.

    ``options`` are the keyword arguments of ``check_layout`` (micro_batch_size, seq_len,
    gpu_memory_gib, sequence_parallel, distributed_optimizer, recompute, interconnect).
    """
    layouts = []
    for tp in _divisors(gpus):
        for pp in _divisors(gpus // tp):
            layouts.append(
                check_layout(
                    spec, gpus, tp, pp, gpus_per_node=gpus_per_node, micro_batches=micro_batches, **options
                )  # type: ignore[arg-type]
            )
    return sorted(layouts, key=_rank_key)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def pretrain_gpt_args(layout: Layout, global_batch_size: int | None = None) -> list[str]:
    """``pretrain_gpt.py`` arguments for a layout (global batch = mbs x micro_batches x DP)."""
    if not layout.valid:
        raise ValueError(f"layout TP={layout.tp} PP={layout.pp} is not valid: {layout.reason}")
    gbs = global_batch_size or layout.micro_batch_size * layout.micro_batches * layout.dp
    if gbs % (layout.micro_batch_size * layout.dp):
        raise ValueError(
            f"global_batch_size: got {gbs}; must be a multiple of micro-batch size x DP "
            f"= {layout.micro_batch_size * layout.dp}"
        )
    args = [
        "--tensor-model-parallel-size", str(layout.tp),
        "--pipeline-model-parallel-size", str(layout.pp),
        "--data-parallel-size", str(layout.dp),
        "--micro-batch-size", str(layout.micro_batch_size),
        "--global-batch-size", str(gbs),
    ]  # fmt: skip
    if layout.sequence_parallel:
        args.append("--sequence-parallel")
    if layout.distributed_optimizer:
        args.append("--use-distributed-optimizer")
    if layout.recompute:
        args += ["--recompute-granularity", layout.recompute]
        if layout.recompute == "full":
            args += ["--recompute-method", "uniform"]
    return args
