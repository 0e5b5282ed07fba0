"""Training stages: one file per stage, each `run(cfg) -> metrics`."""

from __future__ import annotations

from collections.abc import Callable

from lmstack.config.schema import Config


def _sft(cfg: Config) -> dict:
    from lmstack.train import sft

    return sft.run(cfg)


STAGES: dict[str, Callable[[Config], dict]] = {"sft": _sft}
