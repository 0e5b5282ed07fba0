"""Shared fixtures of the inference unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def make_engine():
    """make_engine(model_dir, max_new_tokens, max_batch=4): a greedy ChatEngine on a local model."""
    from lmstack.infer.engine import ChatEngine, load_infer_config

    def make(model_dir, max_new_tokens: int, max_batch: int = 4) -> ChatEngine:
        cfg = {"model_name_or_path": str(model_dir), "template": "qwen", "do_sample": False,
               "max_new_tokens": max_new_tokens}  # fmt: skip
        return ChatEngine.from_config(load_infer_config(None, cfg), max_batch=max_batch)

    return make
