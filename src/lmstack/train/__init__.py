"""Training stages: one file per stage, each `run(plan) -> metrics` (plan: the resolved RunPlan)."""

from __future__ import annotations

from collections.abc import Callable

from lmstack.plan.runplan import RunPlan


def _sft(plan: RunPlan) -> dict:
    from lmstack.train import sft

    return sft.run(plan)


def _pt(plan: RunPlan) -> dict:
    from lmstack.train import pt

    return pt.run(plan)


def _rm(plan: RunPlan) -> dict:
    from lmstack.train import rm

    return rm.run(plan)


def _dpo(plan: RunPlan) -> dict:
    from lmstack.train import dpo

    return dpo.run(plan)


def _kto(plan: RunPlan) -> dict:
    from lmstack.train import kto

    return kto.run(plan)


def _ppo(plan: RunPlan) -> dict:
    from lmstack.train import ppo

    return ppo.run(plan)


def _grpo(plan: RunPlan) -> dict:
    from lmstack.train import grpo

    return grpo.run(plan)


STAGES: dict[str, Callable[[RunPlan], dict]] = {
    "pt": _pt,
    "sft": _sft,
    "rm": _rm,
    "dpo": _dpo,
    "kto": _kto,
    "ppo": _ppo,
    "grpo": _grpo,
    "rloo": _grpo,  # same file: TRL's RLOOTrainer instead of GRPOTrainer
}
