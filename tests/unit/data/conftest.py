"""Fixtures of the data-layer tests: configs built from base_cfg, the qwen template."""

from __future__ import annotations

import pytest

from lmstack.config.load import build_config
from lmstack.templates import get_template


@pytest.fixture
def make_cfg(base_cfg):
    def make(**overrides):
        return build_config({**base_cfg, **overrides})

    return make


@pytest.fixture
def qwen(tiny_tokenizer):
    return get_template("qwen", tiny_tokenizer)
