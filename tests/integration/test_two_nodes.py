"""Two nodes simulated on one host through `lmstack train`'s torchrun relaunch (issue 24, CPU part).

Each "node" is its own `python -m lmstack.cli train cfg.yaml` with NNODES=2, NODE_RANK=0/1,
NPROC_PER_NODE=1, a loopback MASTER_ADDR and FORCE_TORCHRUN=1: the CLI relaunches itself under
torchrun's static rendezvous exactly as on two machines. Both nodes read the same config, so they
share one output_dir, as on a shared file system: lmstack keeps transformers' rule
(save_on_each_node: false, the only value it accepts) that global rank 0 alone writes the outputs,
while every rank adds its own RNG state to each checkpoint.
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

TIMEOUT = 240
STEPS = 8
LOSS_ATOL = 1e-4  # as test_distributed.py: float32 reduction-order noise at most
RDZV_TIMEOUT = 5  # torchrun's static rendezvous waits 600 s by default; PET_RDZV_CONF shortens it


def _env(tmp_path: Path, gpus: str = "", **topology: str) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NNODES", "NODE_RANK")
    }
    env.update(
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES=gpus,  # "": CPU and gloo; a node's own GPU(s) on CUDA
        XDG_CACHE_HOME=str(tmp_path / "xdg"),
        FORCE_TORCHRUN="1",
        MASTER_ADDR="127.0.0.1",
        **topology,
    )
    return env


def _cfg(base_cfg: dict, tmp_path: Path, name: str) -> Path:
    cfg = {
        **base_cfg,
        "output_dir": str(tmp_path / name),
        "cutoff_len": 64,
        "max_samples": 64,
        "max_steps": STEPS,
        "per_device_train_batch_size": 2,  # 2 ranks x 2 = a global batch of 4 in both layouts
        "disable_shuffling": True,
        "ddp_timeout": 120,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(cfg: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "lmstack.cli", "train", str(cfg)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    try:
        results = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [(p.returncode, err) for p, (_, err) in zip(procs, results, strict=True)]


def _losses(out: Path) -> list[float]:
    rows = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines() if x.strip()]
    return [r["loss"] for r in rows if "loss" in r]


def _adapter(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "adapter_model.safetensors")


def _two_gpus() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA GPUs")],
        ),
    ],
)
def test_two_nodes_match_one_node_with_two_processes(base_cfg, tmp_path, device):
    """On CUDA (issue 24's 2 x H200 check) each simulated node sees one GPU of its own, and the
    reference is one node with both GPUs; NCCL instead of gloo, the same assertions."""
    from lmstack.launch.torchrun import free_port

    node_gpus, all_gpus = (("0", "1"), "0,1") if device == "cuda" else (("", ""), "")
    nodes = _cfg(base_cfg, tmp_path, "nodes")
    port = str(free_port())
    start = time.monotonic()
    procs = [
        _train(
            nodes,
            _env(tmp_path, gpus, NNODES="2", NODE_RANK=rank, NPROC_PER_NODE="1", MASTER_PORT=port),
        )
        for rank, gpus in zip(("0", "1"), node_gpus, strict=True)
    ]
    (rc0, err0), (rc1, err1) = _wait(procs)
    two_nodes_s = time.monotonic() - start
    assert rc0 == 0, err0[-3000:]
    assert rc1 == 0, err1[-3000:]
    # each node relaunched itself with its own node rank, one process each, the same master
    for rank, err in (("0", err0), ("1", err1)):
        child = next(line for line in err.splitlines() if "child command:" in line)
        assert f"--nnodes 2 --node_rank {rank} --nproc_per_node 1" in child, child
        assert f"--master_addr 127.0.0.1 --master_port {port}" in child, child
    # node 1's only worker is global rank 1 and local rank 0: the ranks are not mixed up per node
    assert sum("rank 0/2 on " in line and "local rank 0" in line for line in err0.splitlines()) == 1, err0
    assert sum("rank 1/2 on " in line and "local rank 0" in line for line in err1.splitlines()) == 1, err1

    one = _cfg(base_cfg, tmp_path, "one")
    single = _train(
        one, _env(tmp_path, all_gpus, NNODES="1", NPROC_PER_NODE="2", MASTER_PORT=str(free_port()))
    )
    [(rc, err)] = _wait([single])
    assert rc == 0, err[-3000:]

    out, ref = tmp_path / "nodes", tmp_path / "one"
    curve, expected = _losses(out), _losses(ref)
    # one trainer_log line per step: node 1 wrote none into the shared output_dir
    assert len(curve) == len(expected) == STEPS, (curve, expected)
    assert curve == pytest.approx(expected, abs=LOSS_ATOL), (curve, expected)
    got, want = _adapter(out), _adapter(ref)
    assert got.keys() == want.keys() and got
    for name, tensor in want.items():
        assert (got[name] - tensor).abs().max().item() <= 1e-5, name
    assert json.loads((out / "run_manifest.json").read_text())["world_size"] == 2
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == STEPS
    # the last checkpoint is committed once, with each rank's RNG state (node 1's from node 1)
    manifest = json.loads((out / f"checkpoint-{STEPS}" / "manifest.json").read_text())
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(manifest["files"]), sorted(manifest["files"])
    assert manifest["world_size"] == 2
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # no staging left
    assert two_nodes_s < TIMEOUT


@pytest.mark.parametrize("node_rank", ["1", "0"])
def test_node_that_cannot_reach_the_master_fails_in_bounded_time(base_cfg, tmp_path, node_rank):
    """One node alone: node 1 whose master never started (nobody listens on MASTER_PORT), or node 0
    whose node 1 never came. The rendezvous gives up after torchrun's timeout (PET_RDZV_CONF), and
    lmstack says so in one line naming the master, NNODES, NODE_RANK and the timeout."""
    from lmstack.launch.torchrun import free_port

    cfg = _cfg(base_cfg, tmp_path, "alone")
    port = free_port()
    env = _env(
        tmp_path,
        "",
        NNODES="2",
        NODE_RANK=node_rank,
        NPROC_PER_NODE="1",
        MASTER_PORT=str(port),
        PET_RDZV_CONF=f"timeout={RDZV_TIMEOUT}",
    )
    # bounded by the rendezvous timeout, not a stopwatch: torchrun's default (600 s) is past _wait's
    # TIMEOUT, so only the shortened rendezvous (its error line below) ends the run before that fails it
    [(rc, err)] = _wait([_train(cfg, env)])
    assert rc == 2, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err[-3000:]
    line = errors[0]
    assert f"found no complete rendezvous at MASTER_ADDR:MASTER_PORT=127.0.0.1:{port}" in line, line
    assert f"NNODES=2, NODE_RANK={node_rank}" in line, line
    assert f"rendezvous timeout of {RDZV_TIMEOUT} s" in line, line
    assert "printed above" not in line  # no rank ran: there is no rank's error to point at
    assert not (tmp_path / "alone").exists()  # no worker started, nothing written


def test_nodes_that_do_not_share_output_dir_stop_at_the_first_checkpoint(base_cfg, tmp_path):
    """Without a shared file system node 0 commits checkpoints without node 1's RNG state, and a resume
    would start the nodes at different steps: the first save stops the run, saying why."""
    from lmstack.launch.torchrun import free_port

    cfg = _cfg(base_cfg, tmp_path, "apart")
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "lmstack.cli",
                "train",
                str(cfg),
                f"output_dir={tmp_path / f'node{rank}'}",
                "save_strategy=steps",
                "save_steps=4",
            ],
            env=_env(tmp_path, "", NNODES="2", NODE_RANK=rank, NPROC_PER_NODE="1", MASTER_PORT=port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for rank in ("0", "1")
    ]
    (rc0, err0), (rc1, _) = _wait(procs)
    assert rc0 != 0 and rc1 != 0
    assert (
        "is not the folder every process writes to: checkpoint-4 lacks rng_state_<rank>.pth of rank(s) 1"
        in err0
    )
    assert not (tmp_path / "node0" / "checkpoint-4").exists()  # nothing a resume could pick up


def test_emitted_torchrun_lines_train_on_two_nodes(base_cfg, tmp_path):
    """`lmstack plan --emit torchrun` for 2 nodes x 1 GPU: each line, run as it is on its "node" (here
    both on loopback, CPU and gloo), trains the plan's recommended layout as one job of world size 2."""
    from lmstack.launch.torchrun import free_port

    cfg = _cfg(base_cfg, tmp_path, "emitted")
    port = free_port()
    plan = subprocess.run(
        [sys.executable, "-m", "lmstack.cli", "plan", str(cfg), "--gpus", "1", "--nodes", "2", "--gpu", "h100",
         "--no-data", "--emit", "torchrun", "--master-addr", "127.0.0.1", "--master-port", str(port)],
        capture_output=True, text=True, check=True, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")},
    )  # fmt: skip
    lines = [x for x in plan.stdout.splitlines() if x and not x.startswith("#")]
    assert len(lines) == 2, plan.stdout
    env = _env(tmp_path, "")
    for name in ("FORCE_TORCHRUN", "MASTER_ADDR"):  # the lines set the topology themselves
        env.pop(name)
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # this venv's torchrun
    procs = [
        subprocess.Popen(
            ["bash", "-c", line], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for line in lines
    ]
    (rc0, err0), (rc1, err1) = _wait(procs)
    assert rc0 == 0, err0[-3000:]
    assert rc1 == 0, err1[-3000:]
    assert sum("rank 0/2 on " in line and "local rank 0" in line for line in err0.splitlines()) == 1, err0
    assert sum("rank 1/2 on " in line and "local rank 0" in line for line in err1.splitlines()) == 1, err1
    out = tmp_path / "emitted"
    assert json.loads((out / "run_manifest.json").read_text())["world_size"] == 2
    assert len(_losses(out)) == STEPS
    # the recommendation's changes reached the run: what the line passes is what was trained
    overrides = dict(w.split("=", 1) for w in lines[0].split(f"train {cfg}", 1)[1].split())
    assert overrides  # the tiny model on an H100: no recompute needed (gradient_checkpointing=false)
    saved = yaml.safe_load((out / "lmstack_config.yaml").read_text())
    for key, raw in overrides.items():
        assert saved[key] == yaml.safe_load(raw.strip("'")), (key, raw, saved.get(key))
