"""Pick the fastest training setup that fits: candidates, a rough cost model, the OOM ladder.

The ladder is the usual OOM ladder (flash + checkpointing -> ZeRO-2 -> ZeRO-3 -> offload -> QLoRA). The
recommendation searches checkpointing, the micro-batch (keeping micro_batch x gradient_accumulation_steps,
the batch the optimizer sees), ZeRO/FSDP stage and offload, Liger's kernels, FP8 (`fp8: true`, a setting,
on GPUs with FP8 tensor cores: plan/fp8_estimate.py) and the method changes (full -> LoRA, -> QLoRA),
under GPU memory, CPU memory (offload) and disk (the checkpoint) and what is installed here (DeepSpeed,
bitsandbytes, Liger: `lmstack check` / `train` refuse or drop what is missing).
It is the fastest setup that fits; a method change is marked as one and taken when nothing of the
configured method fits, or -- LoRA -> QLoRA, still an adapter on a frozen base -- when it is at least
METHOD_CHANGE_MIN_SPEEDUP times faster than the best that does (QLoRA + checkpointing over ZeRO-3 offload
for a 70B LoRA on one 80 GB GPU); full/freeze -> LoRA only when nothing of the configured method fits.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Literal

from lmstack.memory import fp8_estimate
from lmstack.memory import memory as mem
from lmstack.memory.advice import (
    METHOD_CHANGE_MIN_SPEEDUP,
    checkpoint_gib,
    label,
    own_masters,
    reason,
    unsupported,
    yaml_changes,
)
from lmstack.memory.estimate import (
    Estimate,
    Setup,
    estimate,
    peaks_at_backward_start,
    recomputed_layers,
    validate_setup,
)
from lmstack.memory.model_spec import ModelSpec
from lmstack.memory.parallel import Layout, enumerate_layouts
from lmstack.memory.partial_ckpt import describe, smallest_fitting

MICRO_BATCH_CHOICES = (1, 2, 4, 8, 16, 32, 64)
# --- rough relative cost model (time per token; 1.0 = plain DDP, fused CE, flash, big batch) --
RECOMPUTE_COST = (
    1.33  # full checkpointing adds one forward: 8N vs 6N FLOPs (REFERENCE 6.1); k of L layers: k/L of it
)
ZERO12_COMM_COST = 1.02  # reduce-scatter + all-gather = DDP all-reduce volume (ZeRO paper §7)
ZERO3_COMM_COST = 1.15  # 1.5x DDP volume, per-layer gathers in fwd and bwd; rough
OFFLOAD_OPTIMIZER_COST = 1.6  # CPU Adam step + PCIe copies of grads/params; rough (ZeRO-Offload)
OFFLOAD_PARAM_COST = 2.5  # params stream over PCIe every fwd and bwd; rough
UNFUSED_CE_COST = 1.2  # Liger kernels measured +13-28% throughput (REFERENCE 8.2)
EAGER_ATTENTION_COST = 1.3  # eager materialises s x s scores; FA/SDPA 1.2-2x faster (rough)
LORA_COST = 1.0  # 4N vs 6N FLOPs, but PEFT-default LoRA measured no faster than full (REFERENCE 8.2)
QUANT_COST = 1.15  # de-quantization kernels; torchtune -2%, unfused HF slower (REFERENCE 10.11)
# Offloaded checkpointing (use_unsloth_gc): the copies overlap the compute on a side stream, so only the
# part of the PCIe time (memory.PCIE_GB_PER_S) above the step's compute time costs, plus a fixed share for
# the per-layer copy launches and event waits. The compute time uses an assumed achieved bf16 rate. Both
# are estimates, not measurements (the GPU run of bench/lmstack_bench.py 7b_lora_24g is still to come).
OFFLOAD_CKPT_FIXED_COST = 0.02
ASSUMED_ACHIEVED_TFLOPS = 400.0
# Per-step fixed costs (launches, Python) amortise over tokens: efficiency = T / (T + T0),
# T0 ~ 1/h^2 (work per token grows with h^2). Fit to Qwen2.5-0.5B 16K -> 64K tokens: +42%.
LAUNCH_OVERHEAD_TOKENS = 10_000
LAUNCH_OVERHEAD_REF_HIDDEN = 896

StageArg = int | Literal["auto"] | None


@dataclass(frozen=True)
class PlanRequest:
    """What the user's YAML asks for; ``None`` on micro_batch/gradient_checkpointing/fused_ce = search."""

    spec: ModelSpec
    finetuning_type: str = "full"
    lora_rank: int = 8
    lora_target: str | tuple[str, ...] = "all"
    quantization_bit: int | None = None
    seq_len: int = 2048
    micro_batch: int | None = None
    gradient_accumulation_steps: int = 1
    adam_foreach: bool = False  # optim: adamw_torch (torch's AdamW, multi-tensor on a GPU), not the fused one
    # the YAML's master_weights, and whether `auto` would keep the optimizer's fp32 masters for a single/DDP
    # row were gradient_accumulation_steps 1 (plan/decide.master_weight_blockers: nothing else blocks them):
    # a searched micro-batch that changes the accumulation changes the precision scheme with it
    master_weights: str = "auto"
    masters_unless_accumulating: bool = False
    # without ZeRO/FSDP this config runs classic AMP (fp32 weights in the model under autocast) whatever its
    # accumulation: master_weights: model, fp16, another optimizer (from_config._single_process_scheme)
    classic_amp_alone: bool = False
    gradient_checkpointing: bool | None = None
    checkpoint_offload: bool = False  # use_unsloth_gc (the recommendation's search opens it)
    # a resolved run plan's partial checkpointing (plan.checkpoint_layers): k of the layers recompute
    checkpoint_layers: int | None = None
    checkpointing_disabled: bool = False  # disable_gradient_checkpointing: true (LF's switch) in the YAML
    attention: str = "sdpa"
    packing: bool = False
    fused_ce: bool | None = False
    deepspeed_stage: StageArg = None
    offload_optimizer: bool = False
    offload_param: bool = False
    fsdp: bool = False
    fsdp_sharding: str = "FULL_SHARD"
    num_gpus: int = 1  # total GPUs (world size) across all nodes
    gpu_memory_gib: float = 80.0
    nodes: int = 1
    cpu_memory_gib: float | None = None  # per node; None = not checked
    pure_bf16: bool = False
    freeze_trainable_layers: int = 2
    llama_pro: bool = False  # use_llama_pro (estimate.Setup's field of the same name)
    freeze_extra_modules: tuple[str, ...] = ()  # freeze-tuning's trained non-layer modules (estimate.Setup's)
    optimizer: str = "adamw"  # adamw | galore | apollo | badam | muon
    optimizer_rank: int = 16
    liger: bool | None = None  # Liger kernels; None = follow fused_ce (the search toggles both)
    fp32_model_weights: bool = False  # master_weights: model (classic AMP), see estimate.Setup
    fp32_adapters: bool = False
    # the stage's shape (estimate.Setup's fields of the same names; plan/stage_memory.py)
    stage: str = "sft"
    rows_per_example: int = 1
    loss_path: str = "lm"
    reference: str = "none"
    kl_batch: bool = False
    generated_rows: int = 0
    prompt_len: int = 0
    reward_model_params: int = 0
    packed: bool = True
    expandable_segments: bool = False  # plan.allocator (estimate.Setup's field of the same name)
    # where the lengths came from: "cutoff_len" (every row that long), or the data's own longest row
    length_source: str = "cutoff_len"
    worst_seq_len: int | None = None  # seq_len with every row cutoff_len long, shown next to a data-aware one
    # what this machine can run: optional packages installed (None = assume all), free disk at output_dir
    available: frozenset[str] | None = None
    yaml_packages: tuple[
        str, ...
    ] = ()  # optional modules the YAML itself needs (flash_attn for fa2, unsloth)
    # the target's GPUs talk over "nvlink" or "pcie" (memory/gpus.py); None: not said (NVLink assumed)
    interconnect: str | None = None
    unmodelled: tuple[str, ...] = ()  # what the memory model leaves out for this run, said as a note
    disk_free_gib: float | None = None
    # the stage's loss never needs the logits: Liger / the chunked CE can replace the head (STAGE_SPECS)
    stage_fused_ce: bool = True
    multi_process: bool = True  # the stage runs under DeepSpeed / several processes (STAGE_SPECS)
    # FP8 (plan.fp8, plan/fp8_estimate.py): the configured scope (None: fp8 off); the scope `fp8: true` would
    # give this config (None where plan/rules.py refuses it for this method or GPU, `fp8_refused` says why);
    # the GPU's (major, minor) compute capability and name (None: unknown, the search adds no FP8 row)
    fp8: str | None = None
    fp8_allowed: str | None = None
    fp8_refused: str = ""
    gpu_capability: tuple[int, int] | None = None
    gpu_name: str | None = None


@dataclass(frozen=True)
class Strategy:
    name: str
    deepspeed_stage: int | None = None
    offload_optimizer: bool = False
    offload_param: bool = False
    fsdp: str | None = None
    method: str | None = None  # None keeps the request's method; "lora" | "qlora4" change it
    fp8: bool | None = None  # None keeps the request's fp8; True / False set it (a setting, not a method)


@dataclass(frozen=True)
class Candidate:
    strategy: Strategy
    setup: Setup
    estimate: Estimate
    fits: bool
    cost: float
    why_not: str = ""

    @property
    def changes_method(self) -> bool:
        return self.strategy.method is not None


@dataclass(frozen=True)
class Recommendation:
    candidate: Candidate
    reason: str
    yaml_changes: dict[str, object]


@dataclass
class PlanResult:
    request: PlanRequest
    candidates: list[Candidate]
    configured: Candidate | None
    recommendation: Recommendation | None
    megatron: list[Layout] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _base_setup(req: PlanRequest) -> Setup:
    stage = None if req.deepspeed_stage == "auto" else req.deepspeed_stage
    return Setup(
        finetuning_type=req.finetuning_type, lora_rank=req.lora_rank, lora_target=req.lora_target,
        quantization_bit=req.quantization_bit, pure_bf16=req.pure_bf16,
        freeze_trainable_layers=req.freeze_trainable_layers, llama_pro=req.llama_pro,
        freeze_extra_modules=req.freeze_extra_modules, num_gpus=req.num_gpus,
        nodes=req.nodes,
        deepspeed_stage=stage, offload_optimizer=req.offload_optimizer, offload_param=req.offload_param,
        fsdp=req.fsdp_sharding if req.fsdp else None, micro_batch=req.micro_batch or 1,
        optimizer_batch=(req.micro_batch or 1) * req.gradient_accumulation_steps,
        seq_len=req.seq_len, gradient_checkpointing=bool(req.gradient_checkpointing or req.checkpoint_offload),
        checkpoint_offload=req.checkpoint_offload,
        checkpoint_layers=req.checkpoint_layers if (req.gradient_checkpointing or req.checkpoint_offload) else None,
        attention=req.attention, fused_ce=bool(req.fused_ce), optimizer=req.optimizer, adam_foreach=req.adam_foreach,
        optimizer_rank=req.optimizer_rank, liger=req.liger, fp32_model_weights=req.fp32_model_weights,
        fp32_adapters=req.fp32_adapters, stage=req.stage, rows_per_example=req.rows_per_example,
        loss_path=req.loss_path, reference=req.reference, kl_batch=req.kl_batch,
        generated_rows=req.generated_rows, prompt_len=req.prompt_len,
        reward_model_params=req.reward_model_params, packed=req.packed, fp8=req.fp8,
        expandable_segments=req.expandable_segments,
    )  # fmt: skip


def configured_strategy(req: PlanRequest) -> Strategy:
    base = _base_setup(req)
    if base.fsdp:
        return Strategy(f"fsdp_{base.fsdp.lower()}", fsdp=base.fsdp)
    if base.deepspeed_stage is None:
        return Strategy("single" if req.num_gpus == 1 else "ddp")
    name = f"zero{base.deepspeed_stage}" + ("_offload" if base.offload_optimizer else "")
    return Strategy(name, base.deepspeed_stage, base.offload_optimizer, base.offload_param)


def candidate_strategies(req: PlanRequest, allow_method_change: bool = True) -> list[Strategy]:
    """DDP, ZeRO-1/2/3, offload, FSDP (partitioning only with >1 GPU), then method changes."""
    multi = req.num_gpus > 1
    out = [Strategy("ddp" if multi else "single")]
    if multi:
        # zero2 before zero1: equal memory under DeepSpeed's estimator and equal cost, so ties go
        # to the stage LF ships a template for (examples/deepspeed/ds_z2_config.json).
        out += [Strategy("zero2", 2), Strategy("zero1", 1), Strategy("zero3", 3)]
        out += [
            Strategy("fsdp_shard_grad_op", fsdp="SHARD_GRAD_OP"),
            Strategy("fsdp_full_shard", fsdp="FULL_SHARD"),
        ]
    # Offload helps even on one GPU: the optimizer (and params) leave the GPU.
    out += [Strategy("zero2_offload", 2, True), Strategy("zero3_offload", 3, True, True)]
    configured = configured_strategy(req)
    if allow_method_change and req.quantization_bit is None:
        zero = Strategy("zero3", 3) if multi else Strategy("single")
        if req.finetuning_type != "lora":
            out.append(replace(zero, name=f"lora+{zero.name}", method="lora"))
        out.append(replace(zero, name=f"qlora4+{zero.name}", method="qlora4"))
        out += fp8_strategies(req)
    if req.fp8:
        out = [_fp8_off(st) if _needs_fp8_off(req, st) else st for st in out]
    return out if configured in out else [configured, *out]


def fp8_strategies(req: PlanRequest) -> list[Strategy]:
    """`fp8: true` (a setting, not a method change) on the strategies plan/rules.py allows it with: no
    DeepSpeed; LoRA without FSDP; on a GPU with FP8 tensor cores; for a method the rules accept."""
    if req.fp8 or fp8_estimate.unsearched(req) or not req.fp8_allowed:
        return []  # already on (the other strategies carry it), or not allowed here
    multi = req.num_gpus > 1
    out = [Strategy("ddp+fp8" if multi else "single+fp8", fp8=True)]
    if multi and req.fp8_allowed == "float8-training":
        out.append(Strategy("fsdp_full_shard+fp8", fsdp="FULL_SHARD", fp8=True))
    return out


def _needs_fp8_off(req: PlanRequest, st: Strategy) -> bool:
    """A strategy plan/rules.py refuses with the configured fp8 (or a method change): it runs with fp8: false."""
    lora_fsdp = st.fsdp is not None and req.fp8 == "frozen-base"
    return bool(req.fp8_refused or st.deepspeed_stage is not None or lora_fsdp or st.method)


def _fp8_off(st: Strategy) -> Strategy:
    return replace(st, name=f"{st.name} (no fp8)", fp8=False)


# checkpointing modes (gradient_checkpointing, checkpoint_offload): off, full, offloaded (use_unsloth_gc)
CKPT_OFF, CKPT_FULL, CKPT_OFFLOADED = (False, False), (True, False), (True, True)


def _apply(
    base: Setup,
    st: Strategy,
    ckpt: tuple[bool, bool],
    mb: int,
    fused: bool,
    attn: str,
    fp8: str | None = None,
) -> Setup:
    """`base` with the strategy and the searched choices; `fp8`: the scope a Strategy(fp8=True) turns on."""
    s = replace(
        base, deepspeed_stage=st.deepspeed_stage, offload_optimizer=st.offload_optimizer,
        offload_param=st.offload_param, fsdp=st.fsdp, gradient_checkpointing=ckpt[0],
        checkpoint_offload=ckpt[1], micro_batch=mb, fused_ce=fused, attention=attn,
        checkpoint_layers=base.checkpoint_layers if ckpt[0] else None,
    )  # fmt: skip
    if st.fp8 is not None:
        s = replace(s, fp8=fp8 if st.fp8 else None)
    if st.method in ("lora", "qlora4") and s.reference == "copy":
        s = replace(s, reference="adapter_off")  # LoRA's reference is the adapter-off base
    if st.method == "lora":
        s = replace(s, finetuning_type="lora", quantization_bit=None, optimizer="adamw")
    elif st.method == "qlora4":
        s = replace(s, finetuning_type="lora", quantization_bit=4, optimizer="adamw")
    return s


def evaluate(req: PlanRequest, st: Strategy, s: Setup) -> Candidate:
    est = estimate(req.spec, s)
    usable = req.gpu_memory_gib * mem.SAFETY_MARGIN
    why = unsupported(req, s)
    if why:
        pass
    elif est.gpu.total > usable:
        why = f"GPU: needs {est.gpu.total:.1f} GiB > {usable:.1f} GiB usable per GPU"
    elif req.cpu_memory_gib is not None and est.cpu_gib > req.cpu_memory_gib * mem.SAFETY_MARGIN:
        why = f"CPU: offload needs {est.cpu_gib:.0f} GiB per node > {req.cpu_memory_gib:.0f} GiB"
    elif req.disk_free_gib is not None and checkpoint_gib(req.spec, s) > req.disk_free_gib:
        why = f"disk: a checkpoint needs {checkpoint_gib(req.spec, s):.0f} GiB > {req.disk_free_gib:.0f} GiB free"
    return Candidate(st, s, est, not why, relative_cost(req.spec, s), why)


def micro_batch_choices(req: PlanRequest) -> list[int]:
    """Micro-batches that keep the batch the optimizer sees (micro_batch x gradient_accumulation_steps):
    its divisors; an `auto` micro-batch (None) tries MICRO_BATCH_CHOICES."""
    if not req.micro_batch:
        return list(MICRO_BATCH_CHOICES)
    total = req.micro_batch * req.gradient_accumulation_steps
    return [
        m
        for m in range(1, total + 1)
        if total % m == 0 and (m in MICRO_BATCH_CHOICES or m == req.micro_batch)
    ]


def search(req: PlanRequest, strategies: list[Strategy], open_all: bool = False) -> list[Candidate]:
    """Every strategy x checkpointing x micro-batch x kernel choice the request leaves open
    (`open_all`: the recommendation's search, which opens checkpointing, micro-batch and Liger too)."""
    base = _base_setup(req)
    if open_all:  # the recommendation searches checkpointing afresh (partial rows: partial_checkpointing)
        base = replace(base, checkpoint_layers=None)
    # Liger (its fused CE and its kernels, one switch): searched when the request leaves it open (None),
    # and by the recommendation when the run has no fused loss yet and its stage's loss allows one
    opened = open_all and req.fused_ce is False and req.stage_fused_ce and req.loss_path == "lm"
    fused = [False, True] if (req.fused_ce is None or opened) else [req.fused_ce]
    if len(fused) > 1:
        base = replace(base, liger=None)
    validate_setup(base)
    ckpts = checkpointing_modes(req, open_all)
    mbs = (
        micro_batch_choices(req)
        if open_all
        else ([req.micro_batch] if req.micro_batch else list(MICRO_BATCH_CHOICES))
    )
    attns = [req.attention] + (["sdpa"] if req.attention == "eager" else [])
    out = []
    for st, mb, fu, at in itertools.product(strategies, mbs, fused, attns):
        row = {}
        for ckpt in ckpts:
            if ckpt == CKPT_OFFLOADED and open_all and (st.deepspeed_stage == 3 or st.fsdp):
                continue  # use_unsloth_gc is refused with sharded weights (plan/decide.py): not a choice
            s = _apply(base, st, ckpt, mb, fu, at, req.fp8_allowed)
            if not req.micro_batch:  # an auto micro-batch keeps gradient_accumulation_steps (advice.py)
                s = replace(s, optimizer_batch=mb * req.gradient_accumulation_steps)
            row[ckpt] = evaluate(req, st, _precision_of_row(req, s))
        out += row.values()
        # checkpointing left to the planner: partial rows (k of N layers) between "off" and each "all" mode;
        # use_unsloth_gc under gradient_checkpointing: auto has no "off" (checkpointing stays on, offloaded)
        pairs = [(row.get(CKPT_OFF), row[full]) for full in (CKPT_FULL, CKPT_OFFLOADED) if full in row]
        if CKPT_OFF not in row:
            pairs = pairs if req.checkpoint_offload and req.gradient_checkpointing is None else []
        out += [c for c in (partial_checkpointing(req, off, full) for off, full in pairs) if c]
    return out


def _precision_of_row(req: PlanRequest, s: Setup) -> Setup:
    """The precision scheme a searched row would run with, not the configured strategy's: DeepSpeed rows
    (ZeRO-0 too) hold bf16 weights with the fp32 masters in DeepSpeed's optimizer; single/DDP rows keep the
    optimizer's masters under master_weights: auto only without gradient accumulation (their bf16 gradients
    would accumulate in bf16), else classic AMP (fp32 weights in the model), which is also what a config that
    blocks the masters for another reason runs. FSDP rows keep the fp32 masters in MixedPrecision, bf16 compute
    weights as a config naming FSDP is estimated (from_config), whatever the configured strategy runs; LoRA
    keeps its bf16 base (classic AMP never applies to it)."""
    if own_masters(s):
        return replace(s, fp32_model_weights=False)
    if req.masters_unless_accumulating:
        return replace(s, fp32_model_weights=s.optimizer_batch > s.micro_batch)
    if req.classic_amp_alone:
        return replace(s, fp32_model_weights=True)
    return s


def partial_checkpointing(req: PlanRequest, off: Candidate | None, full: Candidate) -> Candidate | None:
    """The smallest number of recomputed layers (1 .. N-1) that fits (plan/partial_ckpt.py), for a row
    that does not fit without checkpointing and fits with every layer recomputed; None otherwise.
    `off` None: checkpointing stays on (use_unsloth_gc), so k = 1 is a choice even when none would fit."""
    if (off is not None and off.fits) or not full.fits:
        return None

    def with_layers(k: int) -> Candidate:
        return evaluate(req, full.strategy, replace(full.setup, checkpoint_layers=k))

    return smallest_fitting(with_layers, req.spec.num_layers)


def checkpointing_modes(req: PlanRequest, open_all: bool) -> list[tuple[bool, bool]]:
    """The request's own mode when fixed; off/full when left auto; and offloaded too in the recommendation."""
    if open_all:
        return [CKPT_OFF, CKPT_FULL, CKPT_OFFLOADED]
    if req.checkpoint_offload:
        return [CKPT_OFFLOADED]
    if req.gradient_checkpointing is not None:
        return [(req.gradient_checkpointing, False)]
    return [CKPT_OFF, CKPT_FULL]


def best(cands: list[Candidate]) -> Candidate | None:
    """Fastest fitting candidate; ties go to less memory. None when nothing fits."""
    fitting = [c for c in cands if c.fits]
    if not fitting:
        return None
    return min(fitting, key=lambda c: (round(c.cost, 3), c.estimate.gpu.total))


def relative_cost(spec: ModelSpec, s: Setup) -> float:
    """Rough time per token relative to an ideal DDP step (named constants above)."""
    tokens = s.micro_batch * s.seq_len
    t0 = LAUNCH_OVERHEAD_TOKENS * (LAUNCH_OVERHEAD_REF_HIDDEN / spec.hidden_size) ** 2
    cost = (tokens + t0) / tokens
    multi = s.num_gpus > 1
    stage = 3 if s.fsdp == "FULL_SHARD" else (2 if s.fsdp else (s.deepspeed_stage or 0))
    if multi and stage >= 3:
        cost *= ZERO3_COMM_COST
    elif multi and stage >= 1:
        cost *= ZERO12_COMM_COST
    cost *= OFFLOAD_OPTIMIZER_COST if s.offload_optimizer else 1.0
    cost *= OFFLOAD_PARAM_COST if s.offload_param else 1.0
    cost *= 1.0 + (RECOMPUTE_COST - 1.0) * recomputed_layers(spec, s) / max(spec.num_layers, 1)
    cost *= 1.0 + offload_checkpoint_cost(spec, s)
    cost *= 1.0 if s.fused_ce else UNFUSED_CE_COST
    cost *= EAGER_ATTENTION_COST if s.attention == "eager" else 1.0
    cost *= LORA_COST if s.finetuning_type == "lora" else 1.0
    cost *= QUANT_COST if s.quantization_bit else 1.0
    cost *= fp8_estimate.time_factor(spec, s)  # FP8 GEMMs (constants and sources in plan/fp8_estimate.py)
    return cost


def offload_checkpoint_cost(spec: ModelSpec, s: Setup) -> float:
    """The share offloaded checkpointing adds to a step: max(0, PCIe time - compute time) / compute time
    + OFFLOAD_CKPT_FIXED_COST (0 without it). PCIe: every layer input to the CPU and back; compute:
    forward + backward + the recompute forward (2N FLOPs per token each, the weight gradient only when
    the base trains) at ASSUMED_ACHIEVED_TFLOPS. An estimate."""
    from lmstack.memory.estimate import offloaded_activations, train_tokens

    if not s.checkpoint_offload:
        return 0.0
    transfer = 2 * offloaded_activations(spec, s) / (mem.PCIE_GB_PER_S * mem.GB)
    passes = 4 if s.finetuning_type == "lora" else 5  # fwd, dgrad, (wgrad,) recompute fwd: 2N FLOPs each
    compute = passes * spec.num_params * train_tokens(s) / (ASSUMED_ACHIEVED_TFLOPS * 1e12)
    compute *= fp8_estimate.time_factor(spec, s)  # FP8 GEMMs shorten the compute the copies hide behind
    return max(0.0, transfer - compute) / compute + OFFLOAD_CKPT_FIXED_COST


def _best_per_strategy(cands: list[Candidate]) -> dict[str, Candidate]:
    out: dict[str, Candidate] = {}
    for name in dict.fromkeys(c.strategy.name for c in cands):
        group = [c for c in cands if c.strategy.name == name]
        out[name] = best(group) or min(group, key=lambda c: c.estimate.gpu.total)
    return out


def recommend(req: PlanRequest, cands: list[Candidate]) -> Recommendation | None:
    """The fastest fitting setup; a method change when nothing of the configured method fits or when it
    is at least METHOD_CHANGE_MIN_SPEEDUP times faster than the best that does."""
    same = best([c for c in cands if not c.changes_method])
    other = best([c for c in cands if c.changes_method])
    rec = same
    # LoRA -> QLoRA keeps the method's kind (an adapter on a frozen base); full/freeze -> an adapter
    # changes what is trained, and is taken only when nothing of the configured method fits
    adapter = req.finetuning_type == "lora"
    faster = (
        same is not None and adapter and same.cost >= METHOD_CHANGE_MIN_SPEEDUP * (other.cost if other else 0)
    )
    if other is not None and (same is None or faster):
        rec = other
    if rec is None:
        return None
    why = reason(req, rec, _best_per_strategy([c for c in cands if not c.changes_method]), same)
    return Recommendation(rec, why, yaml_changes(req, rec))


def configured_candidate(req: PlanRequest, cands: list[Candidate]) -> Candidate:
    """The YAML's own setup: its strategy, micro-batch, checkpointing and kernels (auto fields searched)."""
    strategy = configured_strategy(req)
    group = [c for c in search(req, [strategy])]
    return best(group) or min(group, key=lambda c: c.estimate.gpu.total)


def plan(req: PlanRequest) -> PlanResult:
    """Evaluate the configured setup and every candidate; recommend the fastest that fits."""
    cands = search(req, candidate_strategies(req), open_all=True)
    configured = configured_candidate(req, cands)
    notes = list(req.unmodelled)
    if req.num_gpus == 1 and req.deepspeed_stage not in (None, 0, "auto") and not req.offload_optimizer:
        notes.append("DeepSpeed ZeRO on 1 GPU partitions nothing; only its offload saves GPU memory.")
    if req.attention == "eager":
        notes.append("attention eager stores the s x s score matrix; flash/sdpa removes it.")
    notes += fp8_estimate.notes(req)
    if configured is not None and peaks_at_backward_start(configured.setup):
        notes.append(
            "grads: the configured run's decoder gradients only fill in as its backward frees the activations "
            "(the loss head's transient peaks before any of them exists): the column shows what they add above "
            "the start of the backward (the head's gradient, or the end of the backward's excess), not their "
            "full size; the optimizer step, where all of them are alive, is in the optimizer column"
        )
    megatron: list[Layout] = []
    if req.finetuning_type == "full":
        megatron = enumerate_layouts(
            req.spec, req.num_gpus, max(req.num_gpus // req.nodes, 1), req.gradient_accumulation_steps,
            micro_batch_size=req.micro_batch or 1, seq_len=req.seq_len, gpu_memory_gib=req.gpu_memory_gib,
        )  # fmt: skip
    rec = recommend(req, cands)
    if rec is None:
        smallest = min(cands, key=lambda c: c.estimate.gpu.total)
        notes.append(
            f"nothing fits, not even with LoRA/QLoRA; smallest: {label(smallest, req.spec.num_layers)} at {smallest.estimate.gpu.total:.1f} GiB"
        )
    return PlanResult(req, cands, configured, rec, megatron, notes)


def resolve_auto(req: PlanRequest) -> dict[str, object]:
    """Concrete values for fields set to ``auto`` (deepspeed, micro-batch, checkpointing) + a log line.

    Keys present only for auto fields: ``deepspeed`` (config path or None),
    ``per_device_train_batch_size``, ``gradient_checkpointing`` (and ``checkpoint_layers`` when only that
    many decoder layers recompute: plan/partial_ckpt.py); always ``fits`` and ``message``.
    The method is never changed here; when nothing fits the smallest setup is returned with a warning.
    """
    if req.deepspeed_stage == "auto":
        # `auto` never changes fp8 (numerics): the strategies that would need fp8: false are left out
        strategies = [
            s
            for s in candidate_strategies(req, allow_method_change=False)
            if s.fsdp is None
            and s.fp8 is None
            # use_unsloth_gc is refused under ZeRO-3 (plan/decide.py): never a choice, not even the fallback
            and not (req.checkpoint_offload and s.deepspeed_stage == 3)
        ]
    else:
        strategies = [configured_strategy(req)]
    fixed = replace(req, fused_ce=bool(req.fused_ce))
    cands = search(fixed, strategies)
    chosen = best(cands)
    fits = chosen is not None
    chosen = chosen or min(cands, key=lambda c: c.estimate.gpu.total)
    s, out = chosen.setup, {}
    if req.deepspeed_stage == "auto":
        out["deepspeed"] = yaml_changes(replace(req, deepspeed_stage=None), chosen).get("deepspeed")
    if req.micro_batch is None:
        out["per_device_train_batch_size"] = s.micro_batch
    if req.gradient_checkpointing is None:
        out["gradient_checkpointing"] = s.gradient_checkpointing
        if s.checkpoint_layers is not None:  # partial: k of the decoder layers recompute
            out["checkpoint_layers"] = s.checkpoint_layers
    shown = ", ".join(f"{k}={v}" for k, v in out.items() if k != "checkpoint_layers")
    if s.checkpoint_layers is not None:
        shown += f" ({describe(s.checkpoint_layers, req.spec.num_layers)})"
    total = chosen.estimate.gpu.total
    if fits:
        msg = f"plan: auto -> {shown} (predicted {total:.1f} GiB of {req.gpu_memory_gib:g} GiB per GPU)"
    else:
        msg = (
            f"plan: WARNING nothing fits in {req.gpu_memory_gib:g} GiB; using the smallest setup {shown} "
            f"(predicted {total:.1f} GiB); run `lmstack plan` for LoRA/QLoRA options"
        )
    out.update(fits=fits, message=msg)
    return out
