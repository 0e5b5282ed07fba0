"""The fast host-side defaults change no result: real tiny LoRA runs (packed rows, LoRA dropout so the
RNG stream matters, two epochs so the workers restart) with the YAML's fields unset, with the values a
CUDA run picks written out (2 data workers, fused AdamW), and with both explicitly off, log the same
loss curve in trainer_log.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmstack.train.run import train


def losses(cfg: dict) -> list[float]:
    train(None, cfg)
    out = Path(cfg["output_dir"])
    rows = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines() if x.strip()]
    return [r["loss"] for r in rows if "loss" in r]


def test_fast_defaults_log_the_loss_curve_of_the_plain_settings(base_cfg, tmp_path):
    run = {**base_cfg, "packing": True, "lora_dropout": 0.1, "max_samples": 16, "per_device_train_batch_size": 2, "max_steps": -1,
           "num_train_epochs": 2, "save_strategy": "no"}  # fmt: skip
    unset = losses({**run, "output_dir": str(tmp_path / "unset")})
    cuda_choices = losses({**run, "output_dir": str(tmp_path / "fast"), "dataloader_num_workers": 2,
                           "optim": "adamw_torch_fused"})  # fmt: skip
    off = losses(
        {**run, "output_dir": str(tmp_path / "off"), "dataloader_num_workers": 0, "optim": "adamw_torch"}
    )
    assert len(unset) >= 6 and len(unset) == len(cuda_choices) == len(off)
    # the unset run here is fused AdamW without workers: the workers change nothing, bit for bit
    assert cuda_choices == unset
    # fused against multi-tensor AdamW: the same update, equal up to float rounding
    assert cuda_choices == pytest.approx(off, rel=1e-4)
    saved = (tmp_path / "unset" / "lmstack_config.yaml").read_text()
    assert "optimizer         adamw_torch_fused" in saved and "data_workers      0" in saved


def test_lmstack_train_never_imports_the_heavy_packages_a_plain_run_does_not_use(base_cfg, tmp_path):
    import os
    import subprocess
    import sys

    import yaml

    from lmstack.launch.context import LaunchContext

    installed = {"torchao", "bitsandbytes"} & LaunchContext.from_env(probe_cuda=False).packages
    if not installed:
        pytest.skip("neither torchao nor bitsandbytes is installed: nothing to keep out")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**base_cfg, "max_steps": 2, "max_samples": 8}))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "lmstack.cli", "train", str(path)],
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = {
        ln.rsplit("|", 1)[1].strip()
        for ln in done.stderr.splitlines()
        if ln.startswith("import time:") and "|" in ln
    }
    # a failed import attempt is listed under its top-level name; nothing of either package ran
    assert not {m for m in loaded if m.split(".")[0] in installed and "." in m}
    assert "torchao" not in loaded
    assert "not imported (unused by this run)" in done.stderr + done.stdout
    assert (Path(base_cfg["output_dir"]) / "adapter_model.safetensors").is_file()


def test_sigterm_to_the_whole_process_group_with_data_workers_still_saves(base_cfg, tmp_path):
    """A scheduler's SIGTERM reaches every process of the job, the DataLoader workers too: they inherit the
    trainer's flag-only handler (installed before they fork), so none dies under the main process, which
    finishes its step, saves and exits 143."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import yaml

    repo = Path(__file__).resolve().parents[2]
    cfg = {**base_cfg, "max_steps": 8, "save_steps": 100, "dataloader_num_workers": 2}
    path, flag, log = tmp_path / "run.yaml", tmp_path / "reached", tmp_path / "run.log"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": str(repo / "src"), "LMSTACK_TEST_HOOK": "signal_wait:3",
           "LMSTACK_TEST_FLAG": str(flag), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    driver = repo / "tests" / "integration" / "reliability_driver.py"
    proc = subprocess.Popen([sys.executable, str(driver), str(path)], env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, cwd=repo, start_new_session=True)  # fmt: skip
    deadline = time.time() + 600
    while not flag.is_file():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline, "the hook point was not reached"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGTERM)  # the main process and its DataLoader workers
    assert proc.wait(timeout=300) == 143, log.read_text()[-3000:]
    text = log.read_text()
    assert "stopped by SIGTERM after step 4" in text and "exited unexpectedly" not in text
    assert "error: stopped" not in text  # a requested stop saved a checkpoint: no error
    assert (Path(cfg["output_dir"]) / "checkpoint-4").is_dir()
