"""Shared fixtures: the tiny ChatML tokenizer and a fixed conversation."""

from __future__ import annotations

import pytest

from lmstack.tiny import build_tokenizer

CORPUS = [
    "Hello, how can I help you today?",
    "What is the weather in Paris? It is sunny, 22 degrees.",
    "Be brief. You are a helpful assistant.",
    "<think>\nLet me think about it.\n</think>\n\nThe answer is 4.",
] * 4


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(CORPUS, vocab_size=1024)
