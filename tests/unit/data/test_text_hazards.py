"""Data files as editors and scrapes leave them: a UTF-8 byte-order mark before a JSON array (read
as the array, not as JSON lines that each fail), and control characters (NUL, ESC) in the text, which
are trained as written: `check` prints them escaped and both `check` and `train` warn naming the record."""

from __future__ import annotations

import json
import logging

from lmstack.data.pipeline import load_split
from lmstack.data.validate import check_data, format_report

ROWS = [{"instruction": f"say {i}", "input": "", "output": f"number {i}"} for i in range(6)]


def _registry(tmp_path, name: str, raw: bytes) -> str:
    (tmp_path / f"{name}.json").write_bytes(raw)
    (tmp_path / "dataset_info.json").write_text(json.dumps({name: {"file_name": f"{name}.json"}}))
    return str(tmp_path)


def test_a_json_array_after_a_utf8_bom_is_read_as_the_array(make_cfg, tiny_tokenizer, qwen, tmp_path):
    for indent in (None, 2):
        data_dir = _registry(tmp_path, "bom", b"\xef\xbb\xbf" + json.dumps(ROWS, indent=indent).encode())
        report = check_data(make_cfg(dataset="bom", dataset_dir=data_dir), tiny_tokenizer, qwen)
        entry = report["datasets"][0]
        assert (entry["records"], entry["kept"], entry["problems"]) == (len(ROWS), len(ROWS), [])


def test_control_characters_are_shown_escaped_and_warned_with_the_record(
    make_cfg, tiny_tokenizer, qwen, tmp_path, caplog
):
    rows = [*ROWS[:2], {"instruction": "bad\x00 one", "input": "", "output": "red \x1b[31mtext"}]
    rows = [rows[2], *rows[:2]]  # the first record is the example `check` prints
    data_dir = _registry(tmp_path, "ctrl", json.dumps(rows).encode())
    cfg = make_cfg(dataset="ctrl", dataset_dir=data_dir)
    with caplog.at_level(logging.INFO, logger="lmstack.data"):
        load_split(cfg, "ctrl", "dataset", tiny_tokenizer, qwen)
    warning = f"dataset ctrl: 1 kept records hold control characters, which are tokenized and trained as written: {data_dir}/ctrl.json record 0 (U+0000, U+001B)"
    assert any(r.getMessage().startswith(warning) for r in caplog.records if r.levelno == logging.WARNING)
    text = format_report(check_data(cfg, tiny_tokenizer, qwen))
    assert f"    warning: {warning}" in text
    assert "bad\\x00 one" in text and "red \\x1b[31mtext" in text
    assert "\x00" not in text and "\x1b" not in text
