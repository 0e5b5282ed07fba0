"""A resume refuses, by name and before a step trains, a checkpoint whose manifest verifies but whose
trainer_state.json is malformed or names another step, and an output_dir holding a symbolic link
named like a checkpoint (its target, outside output_dir, is left untouched)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from lmstack.config.errors import ConfigError
from lmstack.reliability.checkpoint import MANIFEST, read_manifest, verify_checkpoint, write_manifest
from lmstack.train.run import train

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model) -> Path:
    """A run stopped at checkpoint-2 (kept as the pristine copy each test starts from)."""
    root = tmp_path_factory.mktemp("pristine")
    run = {
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
        "output_dir": str(root / "run"),
        "per_device_train_batch_size": 4,
        "max_steps": 2,
        "save_steps": 2,
        "report_to": "none",
        "disable_tqdm": True,
    }
    train(None, run)
    (root / "run.json").write_text(json.dumps(run))
    return root


def copy_run(trained: Path, tmp_path: Path) -> tuple[dict, Path]:
    out = tmp_path / "run"
    shutil.copytree(trained / "run", out, symlinks=True)
    run = {**json.loads((trained / "run.json").read_text()), "output_dir": str(out)}
    return {**run, "resume_from_checkpoint": "auto", "max_steps": 4}, out


@pytest.mark.parametrize(
    "state, words",
    [
        ('{"global_step": 2, "log_history": [', r"trainer_state\.json: it is not valid JSON"),
        ('{"global_step": 7}', r"trainer_state\.json: its global_step is 7, the folder is checkpoint-2"),
        ('["global_step", 2]', r"trainer_state\.json: its global_step is None, not a step number"),
    ],
)
def test_a_malformed_trainer_state_is_refused_by_name(trained, tmp_path, state, words):
    auto, out = copy_run(trained, tmp_path)
    ckpt = out / "checkpoint-2"
    meta = {k: v for k, v in read_manifest(ckpt).items() if k not in ("files", "format", "created")}
    (ckpt / "trainer_state.json").write_text(state)
    write_manifest(ckpt, meta)  # the manifest verifies: the bytes are what was saved
    assert verify_checkpoint(ckpt) is None
    with pytest.raises(
        ConfigError, match=re.escape(str(ckpt)) + "/" + words + ".*Resume from another checkpoint-N"
    ):
        train(None, auto)
    assert not (out / "checkpoint-3").exists()


def test_a_symlinked_checkpoint_is_refused_and_its_target_untouched(trained, tmp_path):
    auto, out = copy_run(trained, tmp_path)
    elsewhere = tmp_path / "elsewhere" / "checkpoint-2"
    shutil.copytree(out / "checkpoint-2", elsewhere)
    shutil.rmtree(out / "checkpoint-2")
    (out / "checkpoint-2").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(
        ConfigError, match=r"checkpoint-2 -> .*elsewhere/checkpoint-2: a symbolic link named like"
    ):
        train(None, {**auto, "save_total_limit": 1})
    assert (elsewhere / MANIFEST).is_file() and verify_checkpoint(elsewhere) is None
    assert not (out / "checkpoint-3").exists() and not (out / "checkpoint-4").exists()
