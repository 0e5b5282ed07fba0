"""Checkpoint manifests on plain files: what counts as complete, what resume picks, what rotation keeps."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from lmstack.reliability.checkpoint import (
    MANIFEST,
    clean_staging,
    commit_checkpoint,
    rotate_checkpoints,
    select_resume_checkpoint,
    staging_root,
    verify_checkpoint,
    write_manifest,
)


def make(out: Path, step: int, committed: bool = True) -> Path:
    """A checkpoint the way the trainer writes it: files in staging, then commit (manifest + rename)."""
    staged = staging_root(out, step) / f"checkpoint-{step}"
    (staged / "sub").mkdir(parents=True)
    (staged / "model.safetensors").write_bytes(bytes(range(256)) * (step + 1))
    (staged / "optimizer.pt").write_bytes(b"opt" * 100 + bytes([step]))
    (staged / "sub" / "extra.json").write_text(json.dumps({"step": step}))
    if not committed:
        return staged
    final = commit_checkpoint(staged, out / f"checkpoint-{step}", {"step": step})
    staging_root(out, step).rmdir()
    return final


def test_manifest_lists_every_file_and_verifies(tmp_path):
    ckpt = make(tmp_path, 2)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    assert manifest["step"] == 2 and manifest["format"] == "lmstack-checkpoint/1"
    assert set(manifest["files"]) == {"model.safetensors", "optimizer.pt", "sub/extra.json"}
    assert manifest["files"]["optimizer.pt"]["size"] == 301
    assert verify_checkpoint(ckpt) is None
    assert not list(tmp_path.glob(".checkpoint-*"))


def test_each_kind_of_damage_is_named(tmp_path):
    cases = {
        "flip": lambda c: (c / "model.safetensors").write_bytes(
            b"\x01" + (c / "model.safetensors").read_bytes()[1:]
        ),
        "truncate": lambda c: (c / "optimizer.pt").write_bytes(b"opt"),
        "missing": lambda c: (c / "sub" / "extra.json").unlink(),
        "added": lambda c: (c / "rng_state.pth").write_bytes(b"x"),
        "no_manifest": lambda c: (c / MANIFEST).unlink(),
        "bad_manifest": lambda c: (c / MANIFEST).write_text("{"),
    }
    expected = {
        "flip": "model.safetensors: sha256 differs",
        "truncate": "optimizer.pt has 3 bytes",
        "missing": "sub/extra.json is listed in manifest.json but missing",
        "added": "rng_state.pth not listed in manifest.json",
        "no_manifest": "no manifest.json",
        "bad_manifest": "manifest.json is unreadable",
    }
    for name, damage in cases.items():
        ckpt = make(tmp_path / name, 4)
        damage(ckpt)
        reason = verify_checkpoint(ckpt)
        assert reason is not None and expected[name] in reason, (name, reason)
    # a same-size byte flip passes the cheap check and fails only the sha256 one
    flipped = tmp_path / "flip" / "checkpoint-4"
    assert verify_checkpoint(flipped, deep=False) is None


def test_resume_picks_the_newest_complete_and_logs_the_skipped(tmp_path, caplog):
    make(tmp_path, 2)
    make(tmp_path, 4)
    bad = make(tmp_path, 6)
    (bad / "optimizer.pt").write_bytes(b"opt" * 100 + b"\xff")  # same size, other bytes
    (tmp_path / "checkpoint-8").mkdir()  # killed plain-Trainer save
    (tmp_path / "checkpoint-8" / "model.safetensors").write_bytes(b"partial")
    (tmp_path / "checkpoint-x").mkdir()  # not a checkpoint name: ignored
    caplog.set_level(logging.WARNING)
    assert select_resume_checkpoint(tmp_path) == tmp_path / "checkpoint-4"
    assert "checkpoint-8: no manifest.json" in caplog.text
    assert "checkpoint-6: optimizer.pt: sha256 differs" in caplog.text
    assert select_resume_checkpoint(tmp_path / "nothing-here") is None


def test_stale_staging_dirs_are_removed_and_never_chosen(tmp_path):
    make(tmp_path, 2)
    staged = make(tmp_path, 4, committed=False)
    write_manifest(staged)  # killed between the manifest and the rename
    assert select_resume_checkpoint(tmp_path) == tmp_path / "checkpoint-2"
    removed = clean_staging(tmp_path)
    assert removed == [staging_root(tmp_path, 4)] and not staging_root(tmp_path, 4).exists()
    assert (tmp_path / "checkpoint-2").is_dir()


def test_commit_replaces_an_older_folder_of_the_same_step(tmp_path):
    old = tmp_path / "checkpoint-4"
    old.mkdir()
    (old / "stale.bin").write_bytes(b"old")
    ckpt = make(tmp_path, 4)
    assert not (ckpt / "stale.bin").exists() and verify_checkpoint(ckpt) is None
    assert not list(tmp_path.glob(".checkpoint-*"))


def test_rotation_keeps_the_newest_complete_ones_only(tmp_path):
    for step in (2, 4, 6):
        make(tmp_path, step)
    (tmp_path / "checkpoint-8").mkdir()  # incomplete and newer: must not count towards the limit
    deleted = rotate_checkpoints(tmp_path, 1)
    assert deleted == [tmp_path / "checkpoint-4", tmp_path / "checkpoint-2"]
    assert verify_checkpoint(tmp_path / "checkpoint-6") is None  # the last complete one survives
    assert (tmp_path / "checkpoint-8").is_dir()
    assert rotate_checkpoints(tmp_path, None) == []


def test_rotation_keeps_the_best_checkpoint(tmp_path):
    for step in (2, 4, 6):
        make(tmp_path, step)
    rotate_checkpoints(tmp_path, 1, keep=(str(tmp_path / "checkpoint-2"),))
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-6"]


def test_the_best_checkpoint_counts_towards_the_limit(tmp_path):
    """transformers' rule: save_total_limit N with load_best_model_at_end keeps the best and the N-1 newest."""
    for step in (2, 4, 6, 8):
        make(tmp_path, step)
    rotate_checkpoints(tmp_path, 2, keep=(str(tmp_path / "checkpoint-2"),))
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-8"]
    make(tmp_path, 10)
    rotate_checkpoints(tmp_path, 2, keep=(str(tmp_path / "checkpoint-10"),))  # the best is the newest
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-8"]
