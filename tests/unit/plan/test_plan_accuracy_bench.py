"""bench/plan_accuracy.py --dry-run on the CPU: the GPU accuracy runs' configs are real (predicted, then
trained one step through `lmstack train` on the tiny model), and each row is written as the GPU run
writes it -- predicted before measured, with the planner version that predicted it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lmstack

REPO = Path(__file__).resolve().parents[3]
SRC = str(Path(lmstack.__file__).resolve().parents[1])


def test_dry_run_predicts_and_trains_each_run_on_the_cpu(tmp_path):
    out = tmp_path / "acc.json"
    env = {**os.environ, "PYTHONPATH": SRC, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    runs = "dpo_0.5b_lora_mb4,qlora4_unpacked_0.5b_mb8"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "plan_accuracy.py"), "--dry-run", "--only", runs,
         "--work", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["name"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(rows) == set(runs.split(","))
    sys.path.insert(0, str(REPO / "bench"))
    from plan_accuracy import planner_version

    for row in rows.values():
        assert row["basis"] == "predicted" and row["planner_version"] == planner_version()
        assert row["data_aware"] and row["lengths"]["seq_len"] < row["lengths"]["worst_seq_len"]
        assert row["predicted_gib"] == row["predicted"]["allocated"] > 0
    dpo = rows["dpo_0.5b_lora_mb4"]
    assert dpo["status"] == "ok"  # one real DPO step on the CPU
    assert any(name.startswith("reference forward") for name in dpo["predicted"]["terms"])
    assert rows["qlora4_unpacked_0.5b_mb8"]["status"].startswith("predicted only")
