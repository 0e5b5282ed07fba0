"""USE_RAY=1 end to end on CPU: LF's Ray example YAML (model path and dataset_dir swapped to the tiny
ones, a few steps) trains on 2 Ray Train workers (gloo, 1 CPU each) in a local Ray cluster that the run
starts and shuts down, and equals the 2-process torchrun run of the same YAML: the same loss curve and
the same adapter. A Ray worker killed mid-run stops the run with a plain message and no final outputs;
the next run resumes from the last complete checkpoint and ends with the same adapter.

Every run is a real subprocess (`python -m lmstack.cli train`, `python -m torch.distributed.run`); the
kill waits on the checkpoint the hook reports, never on a clock. No Ray process outlives its run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
LF_RAY_YAML = REPO / "tests" / "fixtures" / "lf_ray" / "qwen3_lora_sft_ray.yaml"
TIMEOUT = 900  # a whole Ray run: cluster start, workers, training, shutdown (2 shared CPU cores)
LOSS_ATOL = 1e-4  # the runs do the same float32 work in the same order: equal up to reduction noise
# the same YAML, a few steps: short sequences and samples, a checkpoint halfway; data preparation in
# this process (speed only); 2 Ray workers in a 2-CPU local cluster (ray_init_kwargs as LF's JSON string)
SHORT = [
    "max_steps=4",
    "save_steps=2",
    "logging_steps=1",
    "max_samples=32",
    "cutoff_len=96",
    "preprocessing_num_workers=1",
    "dataloader_num_workers=0",
]
RAY = ["ray_num_workers=2", """ray_init_kwargs='{"num_cpus": 2}'"""]


def _env(tmp: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    for name in ("FORCE_TORCHRUN", "USE_RAY", "RAY_ADDRESS", "LMSTACK_OUTPUT_LOCK_HELD"):
        env.pop(name, None)
    env.update(
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        XDG_CACHE_HOME=str(tmp / "xdg"),
        RAY_USAGE_STATS_ENABLED="0",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO / "src"), env.get("PYTHONPATH")) if p),
    )
    env.update(extra)
    return env


def _lf_yaml(where: Path, tiny_model: Path) -> Path:
    text = (
        LF_RAY_YAML.read_text().replace("TINY_MODEL", str(tiny_model)).replace("DATA_DIR", str(REPO / "data"))
    )
    where.mkdir(parents=True, exist_ok=True)
    path = where / LF_RAY_YAML.name
    path.write_text(text)
    return path


def _ray_processes() -> set[int]:
    """Processes of any Ray cluster on this host: its daemons (gcs_server, raylet, ...) and workers."""
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cmd.startswith("ray::") or "/site-packages/ray/" in cmd:
            found.add(int(proc.name))
    return found


def _wait_gone(pids: set[int], timeout: float = 60.0) -> set[int]:
    """The pids among `pids` still alive once they all exited or `timeout` s passed (shutdown is
    asynchronous for the last workers)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        alive = {p for p in pids if Path(f"/proc/{p}").exists() and not _zombie(p)}
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _run_ray(cmd: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    before = _ray_processes()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    left = _wait_gone(_ray_processes() - before)
    assert not left, f"Ray processes left after the run: {sorted(left)}"
    return proc


def _losses(out: Path) -> list[float]:
    rows = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines() if x.strip()]
    return [r["loss"] for r in rows if "loss" in r]


def _adapter(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "adapter_model.safetensors"))


def _assert_same_adapter(a: Path, b: Path) -> None:
    import torch

    left, right = _adapter(a), _adapter(b)
    assert left.keys() == right.keys() and left
    for name in left:
        assert torch.allclose(left[name], right[name], atol=1e-5, rtol=1e-4), name


@pytest.fixture(scope="module")
def torchrun_run(tiny_model, tmp_path_factory) -> Path:
    """The same YAML on 2 torchrun processes (gloo); the Ray fields are the only ones it cannot take
    (they need USE_RAY=1): ray_num_workers back to LF's default."""
    from lmstack.launch.torchrun import free_port

    where = tmp_path_factory.mktemp("torchrun")
    cfg = _lf_yaml(where, tiny_model)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), "-m", "lmstack.cli.main", "train", str(cfg), *SHORT, "ray_num_workers=1"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=where, env=_env(where), capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return where / "tmp_dir"  # LF's relative output_dir, under the run's working directory


def test_lf_ray_yaml_passes_check(tiny_model, tmp_path):
    cfg = _lf_yaml(tmp_path, tiny_model)
    for extra in ({"USE_RAY": "1"}, {}):  # check may run on another machine than the job: no USE_RAY there
        proc = subprocess.run([sys.executable, "-m", "lmstack.cli", "check", str(cfg)], cwd=tmp_path,
                              env=_env(tmp_path, **extra), capture_output=True, text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_ray_fields_without_use_ray_are_refused_before_the_model_loads(tiny_model, tmp_path):
    cfg = _lf_yaml(tmp_path, tiny_model)
    proc = subprocess.run([sys.executable, "-m", "lmstack.cli", "train", str(cfg), *SHORT], cwd=tmp_path,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2
    assert (
        "ray_num_workers: 4: these configure a Ray Train launch, which runs only with USE_RAY=1"
        in proc.stderr
    )
    assert "Loading weights" not in proc.stderr and not (tmp_path / "tmp_dir" / "checkpoint-2").exists()


def test_lf_ray_yaml_on_two_ray_workers_equals_torchrun(torchrun_run, tiny_model, tmp_path):
    cfg = _lf_yaml(tmp_path, tiny_model)
    cmd = [sys.executable, "-m", "lmstack.cli", "train", str(cfg), *SHORT, *RAY]
    proc = _run_ray(cmd, tmp_path, _env(tmp_path, USE_RAY="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "launching 2 Ray Train worker(s) (1 CPU each, gloo)" in proc.stderr
    for rank in (0, 1):  # each Ray worker announced itself as a rank of a 2-process job
        assert f"rank {rank}/2 on " in proc.stderr, proc.stderr[-4000:]
    out = tmp_path / "tmp_dir"  # relative output_dir: the driver's working directory, as with torchrun
    ray_curve, torchrun_curve = _losses(out), _losses(torchrun_run)
    assert len(ray_curve) == len(torchrun_curve) == 4
    assert ray_curve == pytest.approx(torchrun_curve, abs=LOSS_ATOL), (ray_curve, torchrun_curve)
    _assert_same_adapter(out, torchrun_run)
    assert json.loads((out / "run_manifest.json").read_text())["world_size"] == 2
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 4
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    saved = yaml.safe_load((out / "lmstack_config.yaml").read_text())
    assert saved["ray_num_workers"] == 2 and saved["ray_init_kwargs"] == {"num_cpus": 2}
    assert not list(out.glob("lmstack-*")) and not (out / "ray_results").exists()  # Ray's records elsewhere


def test_killed_ray_worker_fails_cleanly_and_the_run_resumes(torchrun_run, tiny_model, tmp_path):
    from lmstack.reliability.checkpoint import verify_checkpoint

    cfg = _lf_yaml(tmp_path, tiny_model)
    flag = tmp_path / "reached.flag"
    env = _env(tmp_path, USE_RAY="1", LMSTACK_TEST_HOOK="block:2", LMSTACK_TEST_FLAG=str(flag))
    before = _ray_processes()
    job = subprocess.Popen([sys.executable, str(HERE / "_ray_driver.py"), str(cfg), *SHORT, *RAY], cwd=tmp_path,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        import time

        deadline = time.monotonic() + TIMEOUT
        while not flag.exists():  # a worker committed checkpoint-2 and blocks before step 3
            assert job.poll() is None, job.stdout.read()[-4000:]
            assert time.monotonic() < deadline, "the run never reached checkpoint-2"
            time.sleep(0.2)
        worker = int(flag.read_text())
        assert worker in _ray_processes()  # a Ray Train worker, not the driver
        os.kill(worker, signal.SIGKILL)
        log, _ = job.communicate(timeout=TIMEOUT)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode != 0
    assert "error: Ray Train: a worker failed, so the run stopped" in log, log[-4000:]
    assert "resume_from_checkpoint: auto" in log
    assert not _wait_gone(_ray_processes() - before), "Ray processes left after the failed run"
    out = tmp_path / "tmp_dir"
    assert verify_checkpoint(out / "checkpoint-2") is None  # complete, with its manifest
    for final in ("adapter_model.safetensors", "all_results.json", "train_results.json"):
        assert not (out / final).exists(), final  # no half-written output
    assert not (out / "checkpoint-4").exists()

    cmd = [
        sys.executable,
        "-m",
        "lmstack.cli",
        "train",
        str(cfg),
        *SHORT,
        *RAY,
        "resume_from_checkpoint=auto",
    ]
    proc = _run_ray(cmd, tmp_path, _env(tmp_path, USE_RAY="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resume_from_checkpoint: auto -> " in proc.stderr and "checkpoint-2" in proc.stderr
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 4
    _assert_same_adapter(out, torchrun_run)
