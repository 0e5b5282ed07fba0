"""config.json has one reader (lmstack.memory.model_facts): what it returns, and that no other module
parses the file itself."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from lmstack.memory import model_facts

SRC = Path(__file__).resolve().parents[3] / "src" / "lmstack"


def test_reads_parses_and_rereads_a_rewritten_file(tmp_path):
    assert model_facts.config_json(tmp_path) is None  # no file
    (tmp_path / "config.json").write_text("{not json")
    assert model_facts.config_json(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 8}))
    first = model_facts.config_json(tmp_path)
    assert first == {"model_type": "qwen2", "hidden_size": 8}
    first["hidden_size"] = 99  # a caller's change does not leak into the next read
    assert model_facts.config_json(tmp_path)["hidden_size"] == 8
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 16}))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a rewrite, whatever the clock's grain
    assert model_facts.model_type(tmp_path) == "llama"
    (tmp_path / "config.json").write_text("[1, 2]")
    assert model_facts.config_json(tmp_path) is None  # JSON, but not an object


def test_no_other_module_parses_config_json():
    reader = re.compile(r"""["']config\.json["']\s*\)?\s*\)?\s*\.read_text|open\([^)]*config\.json""")
    offenders = [
        str(path.relative_to(SRC))
        for path in SRC.rglob("*.py")
        if path.name != "model_facts.py" and reader.search(path.read_text())
    ]
    assert offenders == [], f"config.json read outside lmstack/memory/model_facts.py: {offenders}"
