"""Optimizer and split numbers that cannot train (inf, negative, past the seed's 32 bits, a fractional
record count) are refused by the schema, before anything loads."""

from __future__ import annotations

import pytest

from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config

BASE = {"model_name_or_path": "m", "output_dir": "o"}


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("learning_rate", float("inf")),
        ("adam_epsilon", -1),
        ("adam_epsilon", float("nan")),
        ("seed", 4294967296),
        ("max_grad_norm", -1),
        ("val_size", 1.5),
        ("val_size", float("inf")),
    ],
)
def test_refused(key, value):
    with pytest.raises(ConfigError, match=key):
        build_config({**BASE, key: value})


@pytest.mark.parametrize(
    ("key", "value"), [("val_size", 0.1), ("val_size", 3), ("seed", 4294967295), ("max_grad_norm", 0)]
)
def test_accepted(key, value):
    build_config({**BASE, key: value})
