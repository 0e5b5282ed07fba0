"""LLaMA-Factory's command-line forms through the real CLI (`python -m lmstack.cli.main`), on the tiny
model: seed 001's flag-only command verbatim, and a YAML followed by flags and key=value pairs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data"


def lmstack(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    (cwd / "tmp").mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(cwd / "tmp")}
    return subprocess.run(
        [sys.executable, "-m", "lmstack.cli.main", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_seed_001_flag_command_runs_verbatim(tiny_model, tmp_path):
    """Seed 001's `--key value` command (only the model, data, template and output changed for the
    tiny model; --max_steps 2 added), with its bare `--do_train` and `--bf16`."""
    out = tmp_path / "output" / "llama3-sft"
    proc = lmstack(
        "train",
        "--model_name_or_path", str(tiny_model),
        "--stage", "sft",
        "--do_train",
        "--dataset", "alpaca_zh_demo",
        "--dataset_dir", str(DATA),
        "--template", "qwen",
        "--finetuning_type", "lora",
        "--lora_rank", "16",
        "--lora_target", "q_proj,v_proj",
        "--output_dir", str(out),
        "--per_device_train_batch_size", "2",
        "--gradient_accumulation_steps", "8",
        "--num_train_epochs", "3",
        "--learning_rate", "1e-4",
        "--lr_scheduler_type", "cosine",
        "--bf16",
        "--max_steps", "2",
        "--cutoff_len", "64",
        "--disable_tqdm",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["r"] == 16 and adapter["lora_alpha"] == 32  # LF: alpha = 2 x rank
    assert sorted(adapter["target_modules"]) == ["q_proj", "v_proj"]
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    saved = (out / "lmstack_config.yaml").read_text()
    for line in ("bf16: true", "do_train: true", "learning_rate: 0.0001", "gradient_accumulation_steps: 8"):
        assert line in saved, line
    assert not list((tmp_path / "tmp").glob("lmstack_flags_*"))  # the flags' YAML is removed afterwards


@pytest.mark.parametrize("form", ["flags", "key=value"])
def test_yaml_then_flags_or_key_value(tiny_model, tmp_path, form):
    """A YAML with the seed's train_args fields, then overrides; report_to tensorboard writes events,
    and lr_scheduler_kwargs reaches the Trainer (cosine_with_min_lr ends at its floor, not at 0)."""
    out = tmp_path / "out"
    (tmp_path / "train_args.yaml").write_text(
        f"model_name_or_path: {tiny_model}\nstage: sft\ndo_train: true\nfinetuning_type: lora\n"
        f"lora_rank: 64\nlora_alpha: 128\nlora_target: all\nlora_dropout: 0.05\n"
        f"dataset: alpaca_en_demo\ndataset_dir: {DATA}\ntemplate: qwen\ncutoff_len: 64\nmax_samples: 16\n"
        f"output_dir: {out}\nlogging_steps: 1\nsave_steps: 500\n"
        "num_train_epochs: 3\nper_device_train_batch_size: 2\ngradient_accumulation_steps: 1\n"
        "lr_scheduler_type: cosine\nlearning_rate: 1.0e-4\nwarmup_ratio: 0.0\nbf16: true\n"
        "report_to: tensorboard\ndisable_tqdm: true\n"
    )
    overrides = {
        "max_steps": "2",
        "lora_rank": "8",
        "lr_scheduler_type": "cosine_with_min_lr",
        "lr_scheduler_kwargs": '{"min_lr_rate": 0.5}',
    }
    if form == "flags":
        args = [a for k, v in overrides.items() for a in (f"--{k}", v)]
    else:
        args = [f"{k}={v}" for k, v in overrides.items()]
    proc = lmstack("train", "train_args.yaml", *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 8
    log = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in log if "lr" in r]
    # step 2 at half the schedule: floor + (peak - floor) / 2 = 7.5e-5 (plain cosine: 5e-5)
    assert lrs == pytest.approx([1e-4, 7.5e-5], rel=1e-3), lrs
    assert list((out / "runs").rglob("events.out.tfevents.*"))  # report_to: tensorboard, as before
