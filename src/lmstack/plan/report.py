"""Human table and JSON for a ``PlanResult``."""

from __future__ import annotations

from lmstack.plan.recommend import Candidate, PlanResult, _best_per_strategy

TABLE_COLUMNS = (
    "strategy", "mb", "ckpt", "weights", "grads", "optim", "adapters", "activ", "logits", "overhead", "total", "fits",
)  # fmt: skip


def shown_candidates(result: PlanResult) -> list[Candidate]:
    """Best variant per (strategy, checkpointing): fastest fitting, else the smallest."""
    rows: list[Candidate] = []
    for ckpt in (False, True):
        group = [c for c in result.candidates if c.setup.gradient_checkpointing == ckpt]
        rows += list(_best_per_strategy(group).values()) if group else []
    return sorted(rows, key=lambda c: (not c.fits, c.changes_method, c.cost))


def candidate_dict(c: Candidate) -> dict[str, object]:
    g = c.estimate.gpu.to_dict()
    return {
        "strategy": c.strategy.name,
        "fits": c.fits,
        "micro_batch": c.setup.micro_batch,
        "gradient_checkpointing": c.setup.gradient_checkpointing,
        "fused_ce": c.setup.fused_ce,
        "attention": c.setup.attention,
        "finetuning_type": c.setup.finetuning_type,
        "quantization_bit": c.setup.quantization_bit,
        "changes_method": c.changes_method,
        "relative_cost": round(c.cost, 3),
        "cpu_gib": round(c.estimate.cpu_gib, 1),
        "why_not": c.why_not,
        "per_gpu_gib": {
            k: g[k]
            for k in (
                "weights",
                "gradients",
                "optimizer",
                "adapters",
                "activations",
                "logits",
                "overhead",
                "total",
            )
        },
    }


def format_table(result: PlanResult) -> str:
    """Fixed-width table (GiB per GPU) followed by the recommendation and notes."""
    req = result.request
    lines = [
        f"{req.spec.model_type} {req.spec.num_params / 1e9:.2f}B params, {req.finetuning_type}, "
        f"{req.num_gpus} GPU(s) x {req.gpu_memory_gib:g} GiB, seq_len {req.seq_len}",
        "  ".join(f"{h:>8}" if i else f"{h:<24}" for i, h in enumerate(TABLE_COLUMNS)),
    ]
    for c in shown_candidates(result):
        g = c.estimate.gpu
        nums = (g.weights, g.gradients, g.optimizer, g.adapters, g.activations, g.logits, g.overhead, g.total)
        cells = [
            f"{c.strategy.name:<24}",
            f"{c.setup.micro_batch:>8}",
            f"{'on' if c.setup.gradient_checkpointing else 'off':>8}",
        ]
        cells += [f"{v:>8.1f}" for v in nums] + [f"{'✓' if c.fits else '✗':>8}"]
        lines.append("  ".join(cells))
    rec = result.recommendation
    if rec is None:
        lines.append("recommendation: nothing fits")
    else:
        lines.append("recommendation: " + rec.reason)
        lines += [f"  {k}: {_yaml_value(v)}" for k, v in rec.yaml_changes.items()]
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)


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
    return {
        "candidates": [candidate_dict(c) for c in cands],
        "configured": candidate_dict(result.configured) if result.configured else None,
        "recommendation": None
        if rec is None
        else {**candidate_dict(rec.candidate), "reason": rec.reason, "yaml_changes": rec.yaml_changes},
        "megatron": [layout.to_dict() for layout in result.megatron],
        "notes": list(result.notes),
    }
