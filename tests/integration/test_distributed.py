"""Multi-process training on CPU (gloo): torchrun, the FORCE_TORCHRUN relaunch, a failing rank.

Every job here is a real subprocess (`python -m torch.distributed.run` / `python -m lmstack.cli`)
on the tiny model; each test stays well under 90 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

HERE = Path(__file__).resolve().parent
TIMEOUT = 600  # a safety net for a hang only: the machine running the tests may be heavily loaded
# Same samples per optimizer step, same init (seeded), DDP gradient averaging with the Trainer's
# token-count normalisation across ranks: the curves agree up to float32 reduction-order noise.
LOSS_ATOL = 1e-4


def _env(tmp_path: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.pop("FORCE_TORCHRUN", None)
    env.update(
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        XDG_CACHE_HOME=str(tmp_path / "xdg"),
    )
    env.update(extra)
    return env


def _cfg(base_cfg: dict, tmp_path: Path, name: str, **over) -> Path:
    cfg = {
        **base_cfg,
        "output_dir": str(tmp_path / name),
        "cutoff_len": 64,
        "max_samples": 64,
        "max_steps": 4,
        "disable_shuffling": True,  # sequential order: both layouts see the same samples per step
        **over,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run(cmd: list[str], env: dict) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    return proc, time.monotonic() - start


def _losses(out: Path) -> list[float]:
    rows = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines() if x.strip()]
    return [r["loss"] for r in rows if "loss" in r]


def _torchrun(nproc: int) -> list[str]:
    from lmstack.launch.torchrun import free_port

    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
    ]


def test_two_ranks_match_one_process_with_same_global_batch(base_cfg, tmp_path):
    two = _cfg(base_cfg, tmp_path, "two", per_device_train_batch_size=2)
    one = _cfg(base_cfg, tmp_path, "one", per_device_train_batch_size=4)
    env = _env(tmp_path)
    proc, _ = _run([*_torchrun(2), "-m", "lmstack.cli.main", "train", str(two)], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, _ = _run([sys.executable, "-m", "lmstack.cli", "train", str(one)], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    curve2, curve1 = _losses(tmp_path / "two"), _losses(tmp_path / "one")
    assert len(curve1) == len(curve2) == 4
    assert curve1 == pytest.approx(curve2, abs=LOSS_ATOL), (curve1, curve2)
    state = json.loads((tmp_path / "two" / "trainer_state.json").read_text())
    assert state["global_step"] == 4
    # both ranks saw 2 samples per step; the token counter is summed over ranks
    seen1 = json.loads((tmp_path / "one" / "all_results.json").read_text())["num_input_tokens_seen"]
    seen2 = json.loads((tmp_path / "two" / "all_results.json").read_text())["num_input_tokens_seen"]
    assert seen1 == seen2


def test_force_torchrun_relaunches_lmstack_train(base_cfg, tmp_path):
    cfg = _cfg(base_cfg, tmp_path, "relaunch", per_device_train_batch_size=2, max_steps=2)
    env = _env(tmp_path, FORCE_TORCHRUN="1", NPROC_PER_NODE="2")
    proc, _ = _run([sys.executable, "-m", "lmstack.cli", "train", str(cfg), "logging_steps=1"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    child = next(line for line in proc.stderr.splitlines() if "child command:" in line)
    assert "-m torch.distributed.run" in child and "--nproc_per_node 2" in child
    assert "-m lmstack.cli.main train" in child and child.rstrip().endswith("logging_steps=1")
    # a second worker really ran: each rank announces itself (lmstack's own line, not a library's),
    # and rank 0 recorded the world size it trained in
    lines = proc.stderr.splitlines()
    for rank in (0, 1):
        assert sum(f"rank {rank}/2 on " in line for line in lines) == 1, proc.stderr[-3000:]
    out = tmp_path / "relaunch"
    assert json.loads((out / "run_manifest.json").read_text())["world_size"] == 2
    assert len(_losses(out)) == 2
    assert (out / "adapter_model.safetensors").is_file()


def test_failing_rank_stops_the_whole_job(base_cfg, tmp_path):
    """Rank 1 raises inside its second training step while rank 0 waits in the gradient all-reduce:
    torchrun must tear the job down and exit non-zero, not hang. Rank 0's collective timeout is longer
    than the subprocess's, so only the teardown ends the job before the timeout fails the test."""
    cfg = _cfg(
        base_cfg, tmp_path, "fail", per_device_train_batch_size=2, max_steps=6, ddp_timeout=2 * TIMEOUT
    )
    env = _env(tmp_path)
    cmd = [*_torchrun(2), str(HERE / "_fail_on_rank1.py"), "train", str(cfg)]
    proc, _ = _run(cmd, env)
    assert proc.returncode != 0
    assert "injected failure on rank 1" in proc.stderr
    assert not (tmp_path / "fail" / "train_results.json").exists()


def test_deepspeed_with_fsdp_launch_fails_before_training(base_cfg, tmp_path):
    cfg = _cfg(
        base_cfg,
        tmp_path,
        "fsdpds",
        deepspeed=str(Path(__file__).resolve().parents[2] / "examples/deepspeed/ds_z3_config.json"),
    )
    env = _env(tmp_path, ACCELERATE_USE_FSDP="true")
    proc, _ = _run([sys.executable, "-m", "lmstack.cli", "train", str(cfg)], env)
    assert proc.returncode == 2
    assert "accelerate launched this job with an FSDP config" in proc.stderr
    assert "remove `deepspeed:`" in proc.stderr
    assert "attention sdpa" not in proc.stderr  # stopped before the model was loaded
