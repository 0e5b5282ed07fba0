"""A symbolic link named checkpoint-N (to a checkpoint outside output_dir) is neither resumed from nor
rotated: rotation once deleted the manifest inside the link's target."""

from __future__ import annotations

import json
from pathlib import Path

from lmstack.reliability.checkpoint import (
    MANIFEST,
    commit_checkpoint,
    rotate_checkpoints,
    select_resume_checkpoint,
    staging_root,
    verify_checkpoint,
)


def make(out: Path, step: int) -> Path:
    staged = staging_root(out, step) / f"checkpoint-{step}"
    staged.mkdir(parents=True)
    (staged / "model.safetensors").write_bytes(bytes(range(256)) * (step + 1))
    (staged / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    final = commit_checkpoint(staged, out / f"checkpoint-{step}", {"step": step})
    staging_root(out, step).rmdir()
    return final


def test_a_linked_checkpoint_is_not_resumed_nor_rotated(tmp_path, caplog):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    make(out, 1)
    make(out, 2)
    target = make(elsewhere, 9)
    (out / "checkpoint-9").symlink_to(target, target_is_directory=True)
    assert select_resume_checkpoint(out) == out / "checkpoint-2"
    assert "skipping" in caplog.text and "a symbolic link to" in caplog.text
    deleted = rotate_checkpoints(out, 1)
    assert deleted == [out / "checkpoint-1"]
    assert (target / MANIFEST).is_file() and verify_checkpoint(target) is None  # untouched
    assert (out / "checkpoint-9").is_symlink() and (out / "checkpoint-2").is_dir()
