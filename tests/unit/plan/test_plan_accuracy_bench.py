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


def test_round_4_runs_cover_one_epoch_and_are_summarised_on_their_own(tmp_path):
    """--set r4: each run's data is exactly the rows its steps draw (the longest row's batch is formed), its
    row says round r4, and the JSON summarises each round of predicted runs apart."""
    out = tmp_path / "acc.json"
    env = {**os.environ, "PYTHONPATH": SRC, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "plan_accuracy.py"), "--dry-run", "--set", "r4",
         "--only", "r4_kto_0.5b_lora_mb8", "--work", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    (row,) = doc["runs"]
    assert row["round"] == "r4" and row["status"] == "ok"
    assert row["config"]["max_samples"] == 8 and row["config"]["max_steps"] == 1  # 1 step x micro-batch 8
    assert "the longest of 8 rows" in row["lengths"]["source"]
    assert set(doc["summary_by_round"]) == {"r4"}
    sys.path.insert(0, str(REPO / "bench"))
    from plan_accuracy import epoch_rows

    grpo = {"stage": "grpo", "per_device_train_batch_size": 8, "num_generations": 4}
    assert epoch_rows(grpo, 6) == 12  # prompts: each answered num_generations times
    assert epoch_rows({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}, 3) == 24


def test_peak_breakdown_names_the_live_blocks_at_the_allocation_peak():
    """The diagnostic runs' memory trace (torch.cuda.memory._snapshot's device trace): replayed, the blocks
    live when allocated memory peaked, summed per allocating line; later allocations and freed blocks do not
    count; frames of torch's plumbing are skipped; a block with no Python frame is the autograd engine's."""
    sys.path.insert(0, str(REPO / "bench"))
    from plan_accuracy import peak_breakdown

    gib = 2**30
    mod = {"filename": "/x/site-packages/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"}
    head = {
        "filename": "/x/site-packages/transformers/models/qwen2/modeling_qwen2.py",
        "line": 9,
        "name": "forward",
    }
    loss = {"filename": "/x/site-packages/trl/experimental/orpo/orpo_trainer.py", "line": 5, "name": "ce"}
    trace = [
        {"action": "alloc", "addr": 1, "size": 2 * gib, "frames": [mod, head]},
        {"action": "alloc", "addr": 2, "size": 3 * gib, "frames": [loss, head]},
        {"action": "alloc", "addr": 3, "size": 1 * gib, "frames": []},
        {"action": "free_requested", "addr": 2, "size": 3 * gib},
        {"action": "free_completed", "addr": 2, "size": 3 * gib},
        {"action": "alloc", "addr": 4, "size": 2 * gib, "frames": [loss]},  # 5 GiB live < the 6 GiB peak
    ]
    snap = {
        "device_traces": [trace],
        "segments": [{"blocks": [{"size": 2 * gib, "state": "active_allocated"}]}],
    }
    got = peak_breakdown(snap, measured_bytes=7 * gib)  # 1 GiB allocated before the trace began
    assert got["traced_peak_gib"] == 6.0 and got["allocated_at_end_gib"] == 2.0 and got["events"] == 6
    assert got["untraced_gib"] == 1.0 and got["wrapped"] is False
    rows = dict(got["by_owner"])
    assert rows == {
        "trl/experimental/orpo/orpo_trainer.py:5 ce": 3.0,
        "transformers/models/qwen2/modeling_qwen2.py:9 forward": 2.0,
        "(no Python frame: the autograd engine -- gradients and backward temporaries)": 1.0,
    }
    assert [k for k, _ in got["by_owner"]][0].startswith("trl/")  # largest first
    assert peak_breakdown({"device_traces": []})["traced_peak_gib"] == 0


def test_diagnostic_reruns_are_not_predictions():
    """--set snap rows (a traced re-run of a measured config) have basis "diagnostic" and round "snap": the
    accuracy summaries and tests/unit/plan/test_plan_accuracy.py leave them out."""
    sys.path.insert(0, str(REPO / "bench"))
    from plan_accuracy import STAGES_SNAP, local_row

    assert STAGES_SNAP and all(
        name.startswith("snap_") and over["_snapshot"] for name, _, over, _ in STAGES_SNAP
    )
    predicted = {"allocated": 2.0, "reserved": 2.1}
    lengths = {"source": "cutoff_len", "seq_len": 16}
    row = local_row("snap_r4_orpo_0.5b_full_mb2", "qwen2.5-0.5b", {"stage": "dpo"}, predicted, lengths,
                    {"measured_gib": 2.0}, "gpu")  # fmt: skip
    assert row["basis"] == "diagnostic" and row["round"] == "snap"
    assert local_row("r4_x", "a", {}, predicted, lengths, {}, "gpu")["basis"] == "predicted"


def test_rows_carry_their_round():
    sys.path.insert(0, str(REPO / "bench"))
    from plan_accuracy import STAGES_R5, round_of

    assert [round_of(n) for n in ("r4_dpo_x", "r5_orpo_y", "snap_r4_z", "dpo_0.5b_lora_mb4", "rm_x")] == [
        "r4", "r5", "snap", "earlier", "earlier"
    ]  # fmt: skip
    assert STAGES_R5 and all(round_of(name) == "r5" for name, *_ in STAGES_R5)
