"""What happens when several accelerations are switched on at once (seed 003 §10.7), as rules.

Each rule looks at the validated config and the launch context and either returns nothing (fine),
returns a note (a documented fallback it applied, said once), or raises ConfigError (unsupported).
RULES is the one registry (DESIGN rule 8); every rule has a test in tests/unit/launch/test_rules.py.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

from lmstack.config.errors import ConfigError
from lmstack.config.schema import Config

BNB_MIN_FOR_ZERO3 = (0, 43, 0)


@dataclass(frozen=True)
class LaunchContext:
    """What the config alone does not say: how the job was launched."""

    deepspeed_config: dict | None = None  # the validated JSON when `deepspeed:` is set
    fsdp: bool = False  # an accelerate FSDP launch (ACCELERATE_USE_FSDP)
    world_size: int = 1

    @property
    def zero_stage(self) -> int | None:
        if self.deepspeed_config is None:
            return None
        return int((self.deepspeed_config.get("zero_optimization") or {}).get("stage", 0))


Rule = Callable[[Config, LaunchContext], str | None]


def fsdp_with_deepspeed(cfg: Config, ctx: LaunchContext) -> str | None:
    if ctx.fsdp and cfg.training.deepspeed:
        raise ConfigError(
            f"deepspeed: {cfg.training.deepspeed} was given, but accelerate launched this job with an FSDP "
            "config (distributed_type: FSDP); use one of them: remove `deepspeed:` from the YAML, or launch "
            "without the FSDP accelerate config"
        )
    return None


def unsloth_with_liger(cfg: Config, ctx: LaunchContext) -> str | None:
    if cfg.model.use_unsloth and cfg.model.enable_liger_kernel:
        raise ConfigError(
            "use_unsloth and enable_liger_kernel: both patch the same modules and overwrite each other; "
            "set only one of them to true"
        )
    return None


def unsloth_multi_process(cfg: Config, ctx: LaunchContext) -> str | None:
    if not cfg.model.use_unsloth:
        return None
    if cfg.training.deepspeed or ctx.fsdp or ctx.world_size > 1:
        why = "DeepSpeed" if cfg.training.deepspeed else "FSDP" if ctx.fsdp else f"{ctx.world_size} processes"
        cfg.model.use_unsloth = False
        return (
            f"use_unsloth: ignored — Unsloth runs on a single GPU only and this job uses {why}; "
            "training continues without it"
        )
    return None


def unsloth_owns_attention(cfg: Config, ctx: LaunchContext) -> str | None:
    if cfg.model.use_unsloth and cfg.model.flash_attn != "auto":
        return (
            f"flash_attn: {cfg.model.flash_attn} has no effect with use_unsloth (Unsloth picks the attention)"
        )
    return None


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def qlora_with_zero3(cfg: Config, ctx: LaunchContext) -> str | None:
    if cfg.model.quantization_bit is None or ctx.zero_stage != 3:
        return None
    need = ".".join(map(str, BNB_MIN_FOR_ZERO3))
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(
            f"quantization_bit: {cfg.model.quantization_bit} with ZeRO-3 ({cfg.training.deepspeed}) needs "
            f"bitsandbytes >= {need}; pip install 'bitsandbytes>={need}'"
        )
    have = importlib.metadata.version("bitsandbytes")
    if _version_tuple(have) < BNB_MIN_FOR_ZERO3:
        raise ConfigError(
            f"quantization_bit: {cfg.model.quantization_bit} with ZeRO-3 needs bitsandbytes >= {need} "
            f"(installed: {have}); pip install -U 'bitsandbytes>={need}'"
        )
    return None


RULES: list[Rule] = [
    fsdp_with_deepspeed,
    unsloth_with_liger,
    unsloth_multi_process,
    unsloth_owns_attention,
    qlora_with_zero3,
    # GaLore / APOLLO / BAdam combinations (REFERENCE §2.3) are checked by train/method_rules.py in
    # preflight; a rule that needs the launch context (world size, ZeRO stage, FSDP: e.g. "layer-wise
    # GaLore not distributed", "layer-wise BAdam only under ZeRO-3") is added here in this shape.
]


def apply_rules(cfg: Config, ctx: LaunchContext, rules: list[Rule] | None = None) -> list[str]:
    """Run every rule in order; returns the notes of the fallbacks applied (errors raise)."""
    notes = []
    for rule in RULES if rules is None else rules:
        note = rule(cfg, ctx)
        if note:
            notes.append(note)
    return notes
