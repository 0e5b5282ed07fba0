"""Log lines name their source: lmstack's records read `[lmstack]`, another library's carry its own
name, so a third-party warning (torchao, bitsandbytes) never reads as lmstack's."""

from __future__ import annotations

import logging

from lmstack.cli.main import SourceFormatter


def _line(name: str, level: int, msg: str, tag: str = "") -> str:
    record = logging.LogRecord(name, level, __file__, 1, msg, None, None)
    return SourceFormatter(tag).format(record)


def test_lmstack_records_read_lmstack_and_others_read_their_package():
    assert _line("lmstack.models.load", logging.INFO, "loaded x") == "[lmstack] INFO loaded x"
    assert _line("torchao.quantization", logging.WARNING, "no triton") == "[torchao] WARNING no triton"
    assert _line("bitsandbytes", logging.WARNING, "w") == "[bitsandbytes] WARNING w"
    assert _line("lmstack.rank", logging.INFO, "rank 1/2", " rank1") == "[lmstack rank1] INFO rank 1/2"
