"""Training stages: one file per stage, each `run(cfg) -> metrics`."""

from __future__ import annotations

from collections.abc import Callable

from lmstack.config.schema import Config


def _sft(cfg: Config) -> dict:
    from lmstack.train import sft

    return sft.run(cfg)


def _pt(cfg: Config) -> dict:
    from lmstack.train import pt

    return pt.run(cfg)


def _rm(cfg: Config) -> dict:
    from lmstack.train import rm

    return rm.run(cfg)


def _dpo(cfg: Config) -> dict:
    from lmstack.train import dpo

    return dpo.run(cfg)


def _kto(cfg: Config) -> dict:
    from lmstack.train import kto

    return kto.run(cfg)


def _ppo(cfg: Config) -> dict:
    from lmstack.train import ppo

    return ppo.run(cfg)


def _grpo(cfg: Config) -> dict:
    from lmstack.train import grpo

    return grpo.run(cfg)


STAGES: dict[str, Callable[[Config], dict]] = {
    "pt": _pt,
    "sft": _sft,
    "rm": _rm,
    "dpo": _dpo,
    "kto": _kto,
    "ppo": _ppo,
    "grpo": _grpo,
    "rloo": _grpo,  # same file: TRL's RLOOTrainer instead of GRPOTrainer
}
