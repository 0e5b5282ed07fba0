"""LLaMA-Factory's identity.json ships `{{name}}` / `{{author}}` for the user to fill in; trained as
written, the model learns the braces. Loading such data warns in the train log with the counts, and
`lmstack check` prints the same warning."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from lmstack.data.pipeline import load_split
from lmstack.data.stats import placeholders_in
from lmstack.data.validate import check_data, format_report

DATA = Path(__file__).resolve().parents[3] / "data"


def test_placeholders_are_found_in_any_string_of_a_record():
    record = {"instruction": "hi", "output": "I am {{name}}, by {{ author }}.", "history": [["{{x}}", "y"]]}
    assert placeholders_in(record) == {"{{name}}", "{{ author }}", "{{x}}"}
    assert placeholders_in({"output": "a {{ not a name! }} or {single} or {{}}"}) == set()


def test_unfilled_identity_placeholders_warn_in_train_and_check(make_cfg, tiny_tokenizer, qwen, caplog):
    rows = json.loads((DATA / "identity.json").read_text(encoding="utf-8"))
    names = sum("{{name}}" in json.dumps(r, ensure_ascii=False) for r in rows)
    authors = sum("{{author}}" in json.dumps(r, ensure_ascii=False) for r in rows)
    assert names and authors
    cfg = make_cfg(dataset="identity", dataset_dir=str(DATA), cutoff_len=256)
    with caplog.at_level(logging.INFO, logger="lmstack.data"):
        load_split(cfg, "identity", "dataset", tiny_tokenizer, qwen)
    warning = (
        f"dataset identity: records hold unfilled placeholders: {{{{author}}}} ({authors}), {{{{name}}}} "
        f"({names}) records; the model would learn the braces as written"
    )
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(m.startswith(warning) for m in warned), warned
    assert "sed -i 's/{{name}}/MyModel/g; s/{{author}}/MyTeam/g' FILE" in warned[-1]
    assert f"    warning: {warning}" in format_report(check_data(cfg, tiny_tokenizer, qwen))


def test_data_without_placeholders_does_not_warn(make_cfg, tiny_tokenizer, qwen, caplog):
    cfg = make_cfg(dataset="alpaca_en_demo", dataset_dir=str(DATA), cutoff_len=1024, max_samples=20)
    with caplog.at_level(logging.INFO, logger="lmstack.data"):
        load_split(cfg, "alpaca_en_demo", "dataset", tiny_tokenizer, qwen)
    assert not [r for r in caplog.records if "placeholders" in r.getMessage()]
