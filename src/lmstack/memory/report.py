"""Human table and JSON for a ``PlanResult``."""

from __future__ import annotations

from dataclasses import replace

from lmstack.memory import partial_ckpt
from lmstack.memory.advice import ckpt_cell, target_installs
from lmstack.memory.estimate import estimate
from lmstack.memory.memory import MemoryBreakdown
from lmstack.memory.recommend import Candidate, PlanResult, _best_per_strategy

TABLE_COLUMNS = (
    "strategy", "mb", "ckpt", "weights", "grads", "optim", "adapters", "activ", "logits", "stage", "alloc",
    "frag", "ctx", "total", "fits",
)  # fmt: skip
BREAKDOWN_ROWS = (
    ("weights", "weights"),
    ("gradients", "gradients"),
    ("optimizer", "optimizer states"),
    ("adapters", "adapters (weights, grads, optimizer)"),
    ("activations", "activations"),
    ("logits", "loss head (logits / fused log-probs)"),
)


def shown_candidates(result: PlanResult) -> list[Candidate]:
    """Best variant per (strategy, checkpointing): fastest fitting, else the smallest."""
    rows: list[Candidate] = []
    # off, full, offloaded (use_unsloth_gc), partial (k of the N layers recompute: plan/partial_ckpt.py),
    # partial with the recomputed layers' inputs offloaded
    groups = (
        (False, False, False),
        (True, False, False),
        (True, True, False),
        (True, False, True),
        (True, True, True),
    )
    for ckpt in groups:
        group = [
            c for c in result.candidates
            if (c.setup.gradient_checkpointing, c.setup.checkpoint_offload,
                c.setup.checkpoint_layers is not None) == ckpt
        ]  # fmt: skip
        rows += list(_best_per_strategy(group).values()) if group else []
    return sorted(rows, key=lambda c: (not c.fits, c.cost))


def candidate_dict(c: Candidate) -> dict[str, object]:
    g = c.estimate.gpu.to_dict()
    keys = ("weights", "gradients", "optimizer", "adapters", "activations", "logits", "stage", "allocated",
            "fragmentation", "reserved", "cuda_context", "overhead", "total")  # fmt: skip
    return {
        "strategy": c.strategy.name,
        "fits": c.fits,
        "micro_batch": c.setup.micro_batch,
        "gradient_checkpointing": c.setup.gradient_checkpointing,
        "checkpoint_offload": c.setup.checkpoint_offload,
        "checkpoint_layers": c.setup.checkpoint_layers,  # partial checkpointing: layers recomputed (None: all)
        "fused_ce": c.setup.fused_ce,
        "attention": c.setup.attention,
        "finetuning_type": c.setup.finetuning_type,
        "quantization_bit": c.setup.quantization_bit,
        "fp8": c.setup.fp8,
        "changes_method": c.changes_method,
        "relative_cost": round(c.cost, 3),
        "cpu_gib": round(c.estimate.cpu_gib, 1),
        "offloaded_activations_cpu_gib": round(c.estimate.offloaded_activations_gib, 2),
        "why_not": c.why_not,
        # comparable with torch.cuda.max_memory_allocated() / max_memory_reserved()
        "allocated_gib": g["allocated"],
        "reserved_gib": g["reserved"],
        "seq_len": c.setup.seq_len,
        "per_gpu_gib": {k: g[k] for k in keys},
        "weights_gib": {name: round(v, 3) for name, v in c.estimate.weight_rows},  # by storage (FP8 / bf16)
        "stage_terms_gib": g["terms"],
    }


def breakdown_lines(c: Candidate) -> list[str]:
    """Every row of one candidate's peak, the stage's own terms and the margins named."""
    g = c.estimate.gpu
    lines = []
    for key, label in BREAKDOWN_ROWS:
        if getattr(g, key):
            lines.append(f"{label:<58}{getattr(g, key):>8.2f} GiB")
        if key == "weights":  # the FP8 base and what stays bf16
            lines += [f"{'  of which ' + name:<58}{v:>8.2f} GiB" for name, v in c.estimate.weight_rows]
    lines += [f"{name:<58}{v:>8.2f} GiB" for name, v in g.terms]
    lines += [
        f"{'= allocated (compare: torch.cuda.max_memory_allocated)':<58}{g.allocated:>8.2f} GiB",
        f"{'+ margin: allocator fragmentation (reserved - allocated)':<58}{g.fragmentation:>8.2f} GiB",
        f"{'= reserved (compare: torch.cuda.max_memory_reserved)':<58}{g.reserved:>8.2f} GiB",
        f"{'+ margin: CUDA context + cuBLAS/NCCL workspaces':<58}{g.cuda_context:>8.2f} GiB",
        f"{'= total on the GPU':<58}{g.total:>8.2f} GiB",
    ]
    return ["  " + line for line in lines]


def worst_case(result: PlanResult) -> MemoryBreakdown | None:
    """The configured setup with every row cutoff_len long (the data-unaware worst case)."""
    req, conf = result.request, result.configured
    if conf is None or req.length_source == "cutoff_len" or req.worst_seq_len in (None, req.seq_len):
        return None
    setup = replace(
        conf.setup,
        seq_len=req.worst_seq_len,
        prompt_len=req.prompt_len and req.worst_seq_len - (req.seq_len - req.prompt_len),
    )
    return estimate(req.spec, setup).gpu


def _lengths_line(result: PlanResult) -> str | None:
    req, worst = result.request, worst_case(result)
    if worst is None or result.configured is None:
        return None
    return (
        f"rows: {req.seq_len} tokens ({req.length_source}) -> {result.configured.estimate.gpu.total:.1f} GiB; "
        f"with every row {req.worst_seq_len} tokens (cutoff_len, the worst case) {worst.total:.1f} GiB"
    )


def format_table(result: PlanResult) -> str:
    """Fixed-width table (GiB per GPU), each rejected row's reason, the configured setup's breakdown,
    the recommendation and notes."""
    req = result.request
    fp8 = f", fp8 {req.fp8}" if req.fp8 else ""
    lines = [
        f"{req.spec.model_type} {req.spec.num_params / 1e9:.2f}B params, {req.stage} {req.finetuning_type}{fp8}, "
        f"{req.num_gpus} GPU(s) x {req.gpu_memory_gib:g} GiB{_gpu_kind(req)}, seq_len {req.seq_len}",
    ]
    lengths = _lengths_line(result)
    if lengths:
        lines.append(lengths)
    lines.append("  ".join(f"{h:>7}" if i else f"{h:<24}" for i, h in enumerate(TABLE_COLUMNS)) + "  why not")
    for c in shown_candidates(result):
        g = c.estimate.gpu
        nums = (g.weights, g.gradients, g.optimizer, g.adapters, g.activations, g.logits, g.stage, g.allocated,
                g.fragmentation, g.cuda_context, g.total)  # fmt: skip
        name = c.strategy.name + (" *" if c.changes_method else "")
        cells = [
            f"{name:<24}",
            f"{c.setup.micro_batch:>7}",
            f"{ckpt_cell(c.setup, req.spec.num_layers, short=True):>7}",
        ]
        cells += [f"{v:>7.1f}" for v in nums] + [f"{'✓' if c.fits else '✗':>7}"]
        lines.append("  ".join(cells) + (f"  {c.why_not}" if c.why_not else ""))
    lines.append(
        "(* = method change; ckpt k/N = the first k of the N decoder layers recompute, the rest keep their "
        "activations; frag and ctx are margins for what the planner does not model term by term)"
    )
    if result.configured is not None:
        k = result.configured.setup.checkpoint_layers
        if k is not None:  # the planner's partial checkpointing (gradient_checkpointing: auto)
            lines.append(
                "gradient_checkpointing: auto -> "
                + partial_ckpt.reason(k, req.spec.num_layers, req.gpu_memory_gib)
            )
        lines.append(f"configured setup ({result.configured.strategy.name}), per GPU:")
        lines += breakdown_lines(result.configured)
    rec = result.recommendation
    if rec is None:
        lines.append("recommendation: nothing fits")
    else:
        lines.append("recommendation: " + rec.reason)
        lines += [f"  {k}: {_yaml_value(v)}" for k, v in rec.yaml_changes.items()]
    for which, pkgs in installs(result).items():
        if pkgs:
            lines.append(f"install on the target for the {which} setup: pip install {' '.join(pkgs)}")
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)


def installs(result: PlanResult) -> dict[str, list[str]]:
    """{"configured" | "recommended": the pip requirements the target needs for that setup} (the planner
    plans for a target that has them: memory/advice.target_installs)."""
    out = {}
    if result.configured is not None:
        out["configured"] = list(target_installs(result.request, result.configured.setup))
    if result.recommendation is not None:
        out["recommended"] = list(target_installs(result.request, result.recommendation.candidate.setup))
    return out


def _gpu_kind(req) -> str:
    """`, sm90 (NVIDIA H200 (SXM)), nvlink`: the target GPU's kind where the request knows it."""
    bits = []
    if req.gpu_capability is not None:
        major, minor = req.gpu_capability
        bits.append(f"sm{major}{minor}" + (f" ({req.gpu_name})" if req.gpu_name else ""))
    if req.interconnect:
        bits.append(req.interconnect)
    return "".join(f", {b}" for b in bits)


def _yaml_value(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def to_json(result: PlanResult, all_candidates: bool = False) -> dict[str, object]:
    """JSON-ready dict: candidates (best per strategy/ckpt unless ``all_candidates``), recommendation, megatron."""
    cands = result.candidates if all_candidates else shown_candidates(result)
    rec = result.recommendation
    req = result.request
    return {
        "candidates": [candidate_dict(c) for c in cands],
        "configured": candidate_dict(result.configured) if result.configured else None,
        "recommendation": None
        if rec is None
        else {**candidate_dict(rec.candidate), "reason": rec.reason, "yaml_changes": rec.yaml_changes},
        "lengths": {
            "seq_len": req.seq_len,
            "source": req.length_source,
            "worst_case_seq_len": req.worst_seq_len,
            "worst_case_gib": None if (w := worst_case(result)) is None else w.to_dict(),
        },
        "megatron": [layout.to_dict() for layout in result.megatron],
        "target_installs": installs(result),
        "notes": list(result.notes),
    }
