"""Shared helpers of the data-layer tests (paths, the `_expect` table of the malformed fixtures)."""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
DATA_DIR = REPO / "data"
BAD_DIR = REPO / "tests" / "fixtures" / "bad_data"


def expected_problems(file_name: str) -> dict[str, tuple[str, str | None]]:
    """position -> (kind, field) from the `_expect` key each bad fixture record carries."""
    path = BAD_DIR / file_name
    out = {}
    if path.suffix == ".jsonl":
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                out[f"line {n}"] = ("bad JSON line", None)
                continue
            if "_expect" in rec:
                out[f"line {n}"] = (rec["_expect"]["kind"], rec["_expect"]["field"])
    else:
        for i, rec in enumerate(json.loads(path.read_text())):
            if not isinstance(rec, dict):
                out[f"record {i}"] = ("wrong type", "<record>")
            elif "_expect" in rec:
                out[f"record {i}"] = (rec["_expect"]["kind"], rec["_expect"]["field"])
    return out
