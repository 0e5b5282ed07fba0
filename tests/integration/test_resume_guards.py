"""Resume and output_dir on the tiny model (CPU): a resume never trains the wrong thing (another
run's folder, a finished run, changed settings, other tokenized data) and output_dir never destroys
what lmstack did not write (the base model, the data, a user's folder)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from lmstack.config.errors import ConfigError, DataError
from lmstack.reliability.checkpoint import MANIFEST, verify_checkpoint, write_manifest
from lmstack.train.run import train

REPO = Path(__file__).resolve().parents[2]
ADAPTER = "adapter_model.safetensors"
NOT_EMPTY = "already exists and is not empty; set overwrite_output_dir: true to replace it"

# Runs `lmstack train <yaml>` and stops for good at one point (the test SIGKILLs it there):
#   save_block:N   checkpoint-N's files are in staging, its manifest is not written
#   final_block    checkpoint-max is committed; the final adapter is half-written in output_dir
DRIVER = """
import os, sys, time
from pathlib import Path
hook, flag = os.environ["HOOK"], Path(os.environ["FLAG"])
def reached():
    flag.write_text(str(os.getpid()))
    time.sleep(600)
if hook.startswith("save_block:"):
    from lmstack.reliability import checkpoint
    step, original = int(hook.split(":")[1]), checkpoint.write_manifest
    def write_manifest(folder, meta=None):
        if (meta or {}).get("step") == step:
            reached()
        return original(folder, meta)
    checkpoint.write_manifest = write_manifest
else:
    from lmstack.models import adapter_save
    def save_model(trainer):
        out = Path(trainer.args.output_dir)
        (out / "adapter_model.safetensors").write_bytes(b"half-written")
        reached()
    adapter_save.save_model = save_model
from lmstack.cli.main import main
sys.exit(main(["train", sys.argv[1]]))
"""


@pytest.fixture
def cfg(base_cfg) -> dict:
    return {
        **base_cfg,
        "max_steps": 4,
        "max_samples": 24,
        "cutoff_len": 64,
        "save_steps": 2,
        "lora_dropout": 0.0,
    }


def tree(out: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under out."""
    return {
        p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }


def log_losses(out: Path) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines()]
    return [(r["current_steps"], r["loss"]) for r in rows if "loss" in r]


def assert_same_adapter(a: Path, b: Path) -> None:
    wa, wb = load_file(a / ADAPTER), load_file(b / ADAPTER)
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=0, atol=1e-6, msg=key)


def cli(argv: list[str]) -> int:
    """`lmstack ...` in this process, its logging setup undone afterwards."""
    from lmstack.cli.main import main

    root, factory = logging.getLogger(), logging.getLogRecordFactory()
    handlers, level, hook, fmt = root.handlers[:], root.level, sys.excepthook, warnings.formatwarning
    try:
        return main(argv)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        logging.setLogRecordFactory(factory)
        sys.excepthook, warnings.formatwarning = hook, fmt


def killed_run(cfg: dict, tmp_path: Path, hook: str) -> None:
    """The CLI in a subprocess, SIGKILLed at `hook`."""
    yml, flag = tmp_path / "killed.yaml", tmp_path / "reached"
    yml.write_text(yaml.safe_dump(cfg))
    env = {
        **os.environ,
        "HOOK": hook,
        "FLAG": str(flag),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    log = (tmp_path / "killed.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(yml)], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO
    )
    deadline = time.time() + 240
    while not flag.is_file():
        assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
        assert time.time() < deadline, "hook point not reached"
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


# ---- another run's folder -----------------------------------------------------------------------


def test_auto_resume_on_another_runs_folder_is_refused_like_without_auto(cfg, tmp_path):
    out = tmp_path / "other"
    out.mkdir()
    (out / ADAPTER).write_bytes(b"someone else's adapter")
    (out / "README.md").write_text("my model card")
    before = tree(out)
    with pytest.raises(ConfigError) as plain:
        train(None, {**cfg, "output_dir": str(out)})
    with pytest.raises(ConfigError) as auto:
        train(None, {**cfg, "output_dir": str(out), "resume_from_checkpoint": "auto"})
    assert NOT_EMPTY in str(plain.value) and NOT_EMPTY in str(auto.value)
    assert str(auto.value).startswith(str(plain.value))  # the same message, plus why auto did not resume
    assert f"{ADAPTER}" in str(auto.value) and "no complete lmstack checkpoint" in str(auto.value)
    assert tree(out) == before


def test_auto_resume_after_a_kill_before_the_first_save_starts_fresh(cfg, tmp_path):
    out = tmp_path / "early"
    out.mkdir()
    (out / "run_manifest.json").write_text("{}")  # what a run killed in step 1 leaves
    (out / "trainer_log.jsonl").write_text("")
    (out / ".checkpoint-2.staging").mkdir()
    train(None, {**cfg, "max_steps": 2, "output_dir": str(out), "resume_from_checkpoint": "auto"})
    assert verify_checkpoint(out / "checkpoint-2") is None and [s for s, _ in log_losses(out)] == [1, 2]


# ---- a finished run -----------------------------------------------------------------------------


def test_resuming_a_finished_run_is_nothing_to_do(cfg, tmp_path, caplog):
    run = {**cfg, "output_dir": str(tmp_path / "done")}
    train(None, run)
    out = Path(run["output_dir"])
    before = tree(out)
    caplog.set_level("INFO")
    metrics = train(None, {**run, "resume_from_checkpoint": "auto"})
    assert "is the run's last step (max_steps 4): nothing to do" in caplog.text
    assert metrics == json.loads((out / "all_results.json").read_text())
    assert not (out / "checkpoint-5").exists()
    assert tree(out) == before  # the adapter and every other output untouched, byte for byte
    yml = tmp_path / "done.yaml"
    yml.write_text(yaml.safe_dump(run))
    assert cli(["train", str(yml), "resume_from_checkpoint=auto"]) == 0
    assert tree(out) == before


def test_kill_while_saving_the_last_checkpoint_resumes_then_is_done(cfg, tmp_path):
    straight = {**cfg, "output_dir": str(tmp_path / "straight")}
    killed = {**cfg, "output_dir": str(tmp_path / "killed")}
    killed_run(killed, tmp_path, "save_block:4")
    out = Path(killed["output_dir"])
    assert not (out / "checkpoint-4").exists() and verify_checkpoint(out / "checkpoint-2") is None
    train(None, straight)
    train(None, {**killed, "resume_from_checkpoint": "auto"})  # steps 3 and 4 from checkpoint-2
    assert log_losses(out) == log_losses(Path(straight["output_dir"]))
    assert_same_adapter(out, Path(straight["output_dir"]))
    before = tree(out)
    train(None, {**killed, "resume_from_checkpoint": "auto"})
    assert tree(out) == before and not (out / "checkpoint-5").exists()


def test_kill_while_writing_the_final_outputs_finishes_them_without_a_step(cfg, tmp_path, caplog):
    straight = {**cfg, "output_dir": str(tmp_path / "straight")}
    killed = {**cfg, "output_dir": str(tmp_path / "killed")}
    killed_run(killed, tmp_path, "final_block")
    out = Path(killed["output_dir"])
    assert verify_checkpoint(out / "checkpoint-4") is None
    assert (out / ADAPTER).read_bytes() == b"half-written" and not (out / "all_results.json").exists()
    train(None, straight)
    caplog.set_level("INFO")
    train(None, {**killed, "resume_from_checkpoint": "auto"})
    assert not (out / "checkpoint-5").exists()
    assert "no step trained; the final outputs are written from it" in caplog.text
    assert log_losses(out) == log_losses(Path(straight["output_dir"]))  # steps 1..4, once each
    assert_same_adapter(out, Path(straight["output_dir"]))
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 4
    before = tree(out)
    caplog.clear()
    train(None, {**killed, "resume_from_checkpoint": "auto"})
    assert "nothing to do" in caplog.text and tree(out) == before


# ---- changed settings ---------------------------------------------------------------------------


def test_resume_refuses_changed_settings_and_accepts_safe_ones(cfg, tmp_path, caplog):
    data = tmp_path / "data"
    shutil.copytree(REPO / "data", data)
    run = {**cfg, "dataset_dir": str(data), "output_dir": str(tmp_path / "run"), "max_steps": 2}
    train(None, run)
    out = Path(run["output_dir"])
    auto = {**run, "resume_from_checkpoint": "auto", "max_steps": 4}
    with pytest.raises(ConfigError) as err:
        train(None, {**auto, "learning_rate": 1e-3, "dataset": "identity"})
    text = str(err.value)
    assert f"resume_from_checkpoint: {out / 'checkpoint-2'} was trained with other settings" in text
    assert "learning_rate: 0.01 -> 0.001" in text and 'dataset: "alpaca_en_demo" -> "identity"' in text
    assert "max_steps: 2 -> 4" in text.split("(safe: ")[1]  # raised: safe, listed as such
    with pytest.raises(ConfigError, match=r"max_steps: 2 -> 1 \(only a raise resumes\)"):
        train(None, {**auto, "max_steps": 1})
    yml = tmp_path / "lr.yaml"
    yml.write_text(yaml.safe_dump({**auto, "learning_rate": 1e-3}))
    assert cli(["train", str(yml)]) == 2
    # the same dataset name, other content
    original = (data / "alpaca_en_demo.json").read_bytes()
    (data / "alpaca_en_demo.json").write_text(json.dumps(json.loads(original)[::-1]))
    with pytest.raises(
        ConfigError, match=r"data file dataset:alpaca_en_demo/alpaca_en_demo\.json: \"[0-9a-f]+"
    ):
        train(None, auto)
    (data / "alpaca_en_demo.json").write_bytes(original)
    assert not (out / "checkpoint-3").exists()
    # safe: a longer run, another cadence, the data moved to another dataset_dir
    moved = tmp_path / "moved"
    shutil.copytree(data, moved)
    caplog.set_level("INFO")
    train(None, {**auto, "logging_steps": 2, "save_steps": 1, "dataset_dir": str(moved)})
    assert "safe to resume with: " in caplog.text and "dataset_dir: " in caplog.text
    assert verify_checkpoint(out / "checkpoint-4") is None and verify_checkpoint(out / "checkpoint-3") is None
    # a checkpoint saved without the record (older lmstack): resumes, with a warning
    write_manifest(out / "checkpoint-4", {"step": 4})
    caplog.clear()
    train(None, {**auto, "max_steps": 5, "learning_rate": 1e-3})
    assert "does not record the run it was trained with" in caplog.text
    assert verify_checkpoint(out / "checkpoint-5") is None


# ---- output_dir against the inputs --------------------------------------------------------------


@pytest.mark.parametrize(
    "where", ["model", "inside_model", "around_model", "adapter", "dataset_dir", "around_data"]
)
def test_output_dir_on_a_model_adapter_or_data_is_refused_before_anything_loads(
    cfg, tiny_model, tmp_path, where
):
    model = tmp_path / "models" / "base"
    shutil.copytree(tiny_model, model)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    data = tmp_path / "work" / "data"
    shutil.copytree(REPO / "data", data)
    run = {**cfg, "model_name_or_path": str(model), "dataset_dir": str(data), "finetuning_type": "full"}
    outputs = {
        "model": (model, "is model_name_or_path itself"),
        "inside_model": (model / "out", "is inside model_name_or_path"),
        "around_model": (tmp_path / "models", "contains model_name_or_path"),
        "adapter": (adapter, "is adapter_name_or_path itself"),
        "dataset_dir": (data, "is dataset_dir itself"),
        "around_data": (tmp_path / "work", "contains dataset_dir"),
    }
    out, words = outputs[where]
    if where == "adapter":
        run.update(finetuning_type="lora", adapter_name_or_path=str(adapter))
    before = tree(tmp_path)
    with pytest.raises(
        ConfigError, match=f"output_dir: {re.escape(str(out))} {words}.*choose an output_dir outside"
    ):
        train(None, {**run, "output_dir": str(out), "overwrite_output_dir": True})
    assert tree(tmp_path) == before


def test_overwrite_output_dir_deletes_only_what_lmstack_wrote(cfg, tmp_path):
    run = {**cfg, "output_dir": str(tmp_path / "run"), "max_steps": 2, "save_steps": 1}
    train(None, run)
    out = Path(run["output_dir"])
    mine = out / "checkpoint-best-by-hand"
    shutil.copytree(out / "checkpoint-2", mine)
    (mine / MANIFEST).unlink()
    (out / "notes.txt").write_text("keep me")
    unknown = out / "checkpoint-9"  # numbered, but no lmstack manifest
    unknown.mkdir()
    (unknown / "weights.bin").write_bytes(b"x")
    kept = {
        k: v
        for k, v in tree(out).items()
        if k.startswith(("checkpoint-best-by-hand", "notes", "checkpoint-9"))
    }
    train(None, {**run, "max_steps": 1, "overwrite_output_dir": True})
    assert not (out / "checkpoint-2").exists() and verify_checkpoint(out / "checkpoint-1") is None
    assert {k: v for k, v in tree(out).items() if k in kept} == kept
    assert [s for s, _ in log_losses(out)] == [1]


# ---- tokenized_path -----------------------------------------------------------------------------


def test_tokenized_path_with_other_data_is_refused_and_the_trained_data_recorded(cfg, tmp_path, caplog):
    tok = tmp_path / "tok"
    run = {**cfg, "tokenized_path": str(tok), "max_steps": 1, "output_dir": str(tmp_path / "a")}
    train(None, run)
    key = json.loads((tok / "key.json").read_text())
    assert key["datasets"] == "alpaca_en_demo" and "alpaca_en_demo.json" in json.dumps(key["dataset"])
    with pytest.raises(DataError) as err:
        train(None, {**run, "dataset": "identity", "output_dir": str(tmp_path / "b")})
    text = str(err.value)
    assert f"tokenized_path: {tok} holds data tokenized from other inputs" in text
    assert (
        "datasets: 'alpaca_en_demo' -> 'identity'" in text
        and "dataset identity: not in the saved data" in text
    )
    with pytest.raises(DataError, match=r"changed: dataset alpaca_en_demo options\.cutoff_len: 64 -> 32\)"):
        train(None, {**run, "cutoff_len": 32, "output_dir": str(tmp_path / "b")})
    assert not (tmp_path / "b" / ADAPTER).exists()
    caplog.set_level("INFO")
    train(None, {**run, "output_dir": str(tmp_path / "c")})
    assert "tokenized from the datasets, template and options this config names" in caplog.text
    manifest = json.loads((tmp_path / "c" / "run_manifest.json").read_text())
    assert manifest["tokenized_data"] == {"path": str(tok), "key": key}
    # a folder saved before keys were recorded: used, with a warning
    (tok / "key.json").unlink()
    caplog.clear()
    train(None, {**run, "output_dir": str(tmp_path / "d")})
    assert "saved without key.json" in caplog.text


@pytest.mark.parametrize("below", ["", "sub"])
def test_output_dir_that_is_or_lies_under_a_file_is_refused_before_anything_loads(cfg, tmp_path, below):
    afile = tmp_path / "not-a-folder"
    afile.write_text("a file")
    out = afile / below if below else afile
    with pytest.raises(
        ConfigError, match=f"output_dir: {re.escape(str(out))} cannot be a folder: .* is an existing file"
    ):
        train(None, {**cfg, "output_dir": str(out)})
    assert afile.read_text() == "a file"
