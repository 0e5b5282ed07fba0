"""Partial gradient checkpointing (speed under a memory bound): only the first k of the N decoder
layers recompute in the backward; the last N - k keep their activations.

Why the first k and not the last: the backward runs from the last layer down, so the kept layers'
activations are used and freed first, and by the time the first recomputed layer runs its forward
again none of them is live -- the one-layer recompute never adds to them (memory.partial_checkpoint_bytes).
The peak is the start of the backward instead: every kept activation plus what the first backward kernels
allocate (without Liger: the final RMSNorm's fp32 backward or the top SwiGLU's).
Checkpointing the last layers instead would hold every kept layer's activations during that recompute.

Memory falls and the recompute cost rises with k, so the best partial setup of one (strategy, micro-batch,
kernels) row is the smallest k that fits: a bisection between "off" (does not fit) and "all" (fits).
The run plan carries k as `plan.checkpoint_layers` (None: every layer); models/checkpointing.py applies it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar


class _Fits(Protocol):
    fits: bool


C = TypeVar("C", bound=_Fits)


def smallest_fitting(evaluate_k: Callable[[int], C], layers: int) -> C | None:
    """The candidate of the smallest k in 1 .. layers - 1 that fits (None when even layers - 1 does not);
    `evaluate_k(k)` builds and evaluates the candidate with k recomputed layers (fits falls with k)."""
    lo, hi, found = 1, layers - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        cand = evaluate_k(mid)
        if cand.fits:
            found, hi = cand, mid - 1
        else:
            lo = mid + 1
    return found


def describe(k: int | None, layers: int) -> str:
    """'checkpointing 20 of 28 layers' ('all 28 layers' for None)."""
    return f"checkpointing all {layers} layers" if k is None else f"checkpointing {k} of {layers} layers"


def reason(k: int, layers: int, gpu_memory_gib: float) -> str:
    """The run plan's reason for a planner-chosen k."""
    return f"{describe(k, layers)}: the smallest count that fits {gpu_memory_gib:g} GiB"
