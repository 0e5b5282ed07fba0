"""`auto` values in a training YAML, resolved by the planner before anything loads.

Fields: `deepspeed: auto` (none, or the ZeRO template that fits), `per_device_train_batch_size: auto`
(the largest micro-batch that fits) and `gradient_checkpointing: auto` (recompute only when memory
requires it). On a GPU machine the planner decides from the model's config.json, the GPU's memory and
the run plan's other decisions (packing, attention, loss kernel, precision); on CPU there is no device
memory to size against, so the choice is plain and logged. Called by `RunPlan.resolve` only.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from lmstack.config.errors import ConfigError

if TYPE_CHECKING:
    from lmstack.plan.runplan import RunPlan

logger = logging.getLogger(__name__)
AUTO_FIELDS = ("deepspeed", "per_device_train_batch_size", "gradient_checkpointing")
CPU_CHOICE = {"deepspeed": None, "per_device_train_batch_size": 1, "gradient_checkpointing": False}


def auto_fields(cfg: Any) -> list[str]:
    return [name for name in AUTO_FIELDS if getattr(cfg.training, name) == "auto"]


def find_template(name: str) -> str:
    """The file of the DeepSpeed template the planner chose (a shipped name such as z3_offload)."""
    from lmstack.launch.deepspeed import resolve_deepspeed_ref

    return str(resolve_deepspeed_ref(name, field="deepspeed: auto"))


def auto_values(draft: RunPlan, gpu_memory_gib: float | None = None) -> tuple[dict, str, bool]:
    """({field: value} for every `auto` field of the draft plan's config, a log line, fits). A partial
    checkpointing choice adds `checkpoint_layers` (k) and `checkpoint_layers_reason` (the run plan's)."""
    fields = auto_fields(draft.cfg)
    memory = gpu_memory_gib if gpu_memory_gib is not None else draft.ctx.gpu_memory_gib
    if draft.device != "cuda" or memory is None:
        chosen = {name: CPU_CHOICE[name] for name in fields}
        shown = ", ".join(f"{k} -> {v}" for k, v in chosen.items())
        return chosen, f"auto on CPU (no GPU memory to size against): {shown}", True
    from lmstack.memory import partial_ckpt, resolve_auto
    from lmstack.plan.from_config import request_from_plan

    try:
        req = request_from_plan(draft, gpus=draft.world_size, gpu_memory_gib=memory)
        decision = resolve_auto(req)
    except (OSError, ValueError, KeyError) as err:
        if (
            fields == ["gradient_checkpointing"]
            and "gradient_checkpointing" not in draft.cfg.training.model_fields_set
        ):
            # the default `auto` without an estimate: LLaMA-Factory's behaviour, recompute
            return (
                {"gradient_checkpointing": True},
                (
                    f"gradient_checkpointing: auto (default) -> true: no memory estimate for "
                    f"{draft.cfg.model.model_name_or_path} ({err}); recomputing as LLaMA-Factory does"
                ),
                True,
            )
        raise ConfigError(
            f"{fields[0]}: auto needs a memory estimate, and none could be made for "
            f"{draft.cfg.model.model_name_or_path} ({err}); set the value yourself"
        ) from None
    chosen = {name: decision.get(name, CPU_CHOICE[name]) for name in fields}
    if decision.get("checkpoint_layers") is not None:  # partial checkpointing: not a config field, a plan one
        chosen["checkpoint_layers"] = decision["checkpoint_layers"]
        chosen["checkpoint_layers_reason"] = partial_ckpt.reason(
            decision["checkpoint_layers"], req.spec.num_layers, memory
        )
    if chosen.get("deepspeed"):
        chosen["deepspeed"] = find_template(chosen["deepspeed"])
    return chosen, decision["message"], bool(decision["fits"])
