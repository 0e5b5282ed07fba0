"""What a new user sees from the real `lmstack` commands (fresh processes, the tiny model, this CPU box):
refusals in plain words before the model loads, logs that say what happened, piped chat that prints the
replies alone, weights that follow the umask, and no load notices of packages the command never uses."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
LOADED = ("Loading weights", "[lmstack] INFO loaded ")  # transformers' load bar, lmstack's load line


def lmstack(*args: str, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "lmstack.cli.main", *args],
        cwd=cwd,
        env=env,
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=lambda: os.umask(0o022),  # the usual umask: new files 0644
    )


def write_cfg(base_cfg: dict, path: Path, **changes) -> Path:
    path.write_text(yaml.safe_dump({**base_cfg, **changes}))
    return path


def no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory) -> Path:
    """A LoRA run of the tiny model (2 steps, a checkpoint at step 2) and its training YAML."""
    root = tmp_path_factory.mktemp("trained")
    cfg = {
        "model_name_or_path": str(tiny_model),
        "template": "qwen",
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "lora",
        "lora_target": "all",
        "dataset": "alpaca_en_demo",
        "dataset_dir": str(REPO / "data"),
        "cutoff_len": 64,
        "max_samples": 16,
        "output_dir": str(root / "out"),
        "per_device_train_batch_size": 4,
        "max_steps": 2,
        "save_steps": 2,
        "report_to": "none",
        "disable_tqdm": True,
        "max_new_tokens": 4,
    }
    path = write_cfg(cfg, root / "lora.yaml")
    done = lmstack("train", str(path), cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    return path


@pytest.mark.skipif(not no_cuda(), reason="the CPU-only machine's advice")
def test_deepspeed_on_a_cpu_only_machine_is_refused_with_advice_for_this_machine(base_cfg, tmp_path):
    ds = REPO / "examples" / "deepspeed" / "ds_z2_config.json"
    path = write_cfg(base_cfg, tmp_path / "cfg.yaml", deepspeed=str(ds))
    done = lmstack("train", str(path), cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "needs a CUDA GPU and this machine has none" in done.stderr
    assert "remove the deepspeed line to train on cpu" in done.stderr
    assert "pip install deepspeed" not in done.stderr  # installing it here moves the crash into mpi4py
    assert "Traceback" not in done.stderr and not any(x in done.stderr for x in LOADED)


def test_a_batch_size_of_zero_is_one_plain_line(base_cfg, tmp_path):
    path = write_cfg(base_cfg, tmp_path / "cfg.yaml", per_device_train_batch_size=0)
    for command in ("train", "check"):
        done = lmstack(command, str(path), cwd=tmp_path)
        assert done.returncode == 2, done.stderr[-3000:]
        assert "per_device_train_batch_size: got 0; allowed: an integer greater than 0 | auto" in done.stderr
        assert "Input should be" not in done.stderr  # pydantic's text of one union member
        assert done.stderr.count("per_device_train_batch_size") == 1


def test_pt_texts_encoded_whole_are_not_logged_as_cut_to_a_huge_length(base_cfg, tmp_path):
    path = write_cfg(
        base_cfg, tmp_path / "cfg.yaml", stage="pt", dataset="c4_demo", max_samples=8, max_steps=1
    )
    done = lmstack("train", str(path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert str(1 << 30) not in done.stderr
    assert "dataset c4_demo: 8 records, 8 kept, 0 dropped (none), texts kept whole" in done.stderr


@pytest.mark.skipif(not no_cuda(), reason="the plan of a machine without a GPU")
def test_plan_without_a_gpu_says_what_it_plans_for(base_cfg, tmp_path):
    path = write_cfg(base_cfg, tmp_path / "cfg.yaml")
    done = lmstack("plan", str(path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.strip().startswith("device "))
    assert "a CUDA GPU is visible" not in line
    assert "no CUDA GPU is visible here: planned for a CUDA GPU of 80 GiB" in line
    named = lmstack("plan", str(path), "--gpu", "h100", cwd=tmp_path)
    assert "planned for 1 x NVIDIA H100" in named.stdout


def test_piped_chat_prints_the_replies_alone_and_no_unused_package_notices(trained):
    done = lmstack("chat", str(trained), cwd=trained.parent, stdin="hi\nclear\nhello\n")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "User:" not in done.stdout and "Assistant:" not in done.stdout
    assert "Welcome" not in done.stdout and "History has been removed" not in done.stdout
    assert done.stdout.strip(), "two replies were expected"
    assert "using the LoRA adapter trained in output_dir" in done.stderr  # the trained adapter answered
    for package in ("[torchao]", "[bitsandbytes]", "torchao/", "bitsandbytes/"):
        assert package not in done.stderr, done.stderr[-3000:]


def test_weights_follow_the_umask(trained):
    out = Path(yaml.safe_load(trained.read_text())["output_dir"])
    written = [out / "adapter_model.safetensors", out / "checkpoint-2" / "adapter_model.safetensors"]
    export_dir = trained.parent / "merged"
    done = lmstack("export", str(trained), f"export_dir={export_dir}", cwd=trained.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[torchao]" not in done.stderr
    merged = sorted(export_dir.glob("*.safetensors"))
    assert merged
    for path in [*written, *merged]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, (path, oct(path.stat().st_mode))
