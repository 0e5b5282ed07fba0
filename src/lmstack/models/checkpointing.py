"""Partial gradient checkpointing: only the first k decoder layers recompute in the backward.

transformers' decoder layers are `GradientCheckpointingLayer`s, each with its own `gradient_checkpointing`
flag, which `activation_checkpointing_enable` (and lmstack's offloaded mode, models/offload_ckpt.py) turns
on for every layer. `keep_activations_above` turns it off again on the layers above the first k, in the
model's layer order. The last layers keep their activations because the backward reaches them first:
their activations are freed before the first recomputed layer runs again (plan/partial_ckpt.py).
"""

from __future__ import annotations

from typing import Any


def decoder_layers(model: Any) -> list[Any]:
    """The model's GradientCheckpointingLayer modules, in forward order (PEFT-wrapped or not)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def keep_activations_above(model: Any, recomputed: int) -> list[Any]:
    """With checkpointing already on, let only the first `recomputed` decoder layers recompute; the others
    keep their activations. Returns the recomputing layers. Refuses a count the model does not have."""
    layers = decoder_layers(model)
    if not 1 <= recomputed <= len(layers):
        raise ValueError(
            f"partial checkpointing: {recomputed} recomputed layers asked for, but {type(model).__name__} "
            f"has {len(layers)} checkpointable decoder layers; the planner's count must be 1 .. {len(layers)}"
        )
    for layer in layers[recomputed:]:
        layer.gradient_checkpointing = False
    return layers[:recomputed]
