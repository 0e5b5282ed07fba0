"""output_dir that cannot be written is refused before the model loads, naming the path; a final save
that stops midway (the disk filled while tokenizer.json was written) leaves outputs that chat/export
refuse and that a resume writes again whole."""

from __future__ import annotations

import errno
import json
import subprocess
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from lmstack.config.errors import ConfigError
from lmstack.infer.export import export
from lmstack.reliability import final_outputs
from lmstack.train.run import train


@pytest.fixture
def cfg(base_cfg) -> dict:
    return {**base_cfg, "max_steps": 2, "save_steps": 2, "max_samples": 16, "cutoff_len": 64}


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only file system (root ignores permission bits, so a chmod would not do)."""
    mount = tmp_path / "ro"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_an_output_dir_that_is_a_file_or_read_only_is_refused_before_the_model_loads(
    cfg, tmp_path, read_only_dir, no_model_load
):
    afile = tmp_path / "taken"
    afile.write_text("not a folder")
    with pytest.raises(ConfigError, match=f"output_dir: {afile} cannot be a folder: {afile} is an existing file"):
        train(None, {**cfg, "output_dir": str(afile)})
    out = read_only_dir / "run"
    with pytest.raises(ConfigError, match=f"output_dir: {read_only_dir} is not writable"):
        train(None, {**cfg, "output_dir": str(out)})


def test_an_export_dir_that_cannot_be_written_is_refused_before_the_model_loads(
    cfg, tmp_path, read_only_dir, no_model_load
):
    exporting = {"model_name_or_path": cfg["model_name_or_path"], "template": "qwen"}
    out = read_only_dir / "merged"
    with pytest.raises(
        ConfigError, match=f"export_dir: {out}: cannot create files in {read_only_dir} \\(Read-only"
    ):
        export(None, {**exporting, "export_dir": str(out)})
    afile = tmp_path / "taken"
    afile.write_text("not a folder")
    with pytest.raises(ConfigError, match=f"export_dir: {afile}/merged lies under {afile}, which is a file"):
        export(None, {**exporting, "export_dir": str(afile / "merged")})


def test_a_final_save_stopped_by_a_full_disk_is_refused_and_finished_by_a_resume(cfg, tmp_path, monkeypatch):
    out = tmp_path / "run"
    run = {**cfg, "output_dir": str(out)}
    original = PreTrainedTokenizerBase.save_pretrained

    def disk_full(self, save_directory, *args, **kwargs):
        if Path(save_directory) != out:  # the checkpoints' tokenizer saves go through
            return original(self, save_directory, *args, **kwargs)
        original(self, save_directory, *args, **kwargs)
        raw = (out / "tokenizer.json").read_bytes()
        (out / "tokenizer.json").write_bytes(raw[: len(raw) // 3])  # what fitted on the disk
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "tokenizer.json"))

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", disk_full)
    with pytest.raises(OSError, match="No space left on device"):
        train(None, run)
    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", original)
    assert (out / "adapter_model.safetensors").is_file() and (out / final_outputs.PENDING).is_file()
    with pytest.raises(json.JSONDecodeError):
        json.loads((out / "tokenizer.json").read_text())
    merged = tmp_path / "merged"
    exporting = {
        "model_name_or_path": cfg["model_name_or_path"],
        "template": "qwen",
        "export_dir": str(merged),
    }
    with pytest.raises(ConfigError, match=f"adapter_name_or_path: {out}: its final save did not finish"):
        export(None, {**exporting, "adapter_name_or_path": str(out)})
    assert not merged.exists()
    train(None, {**run, "resume_from_checkpoint": "auto"})  # writes the final outputs again from checkpoint-2
    assert final_outputs.incomplete(out) is None and (out / final_outputs.FINAL).is_file()
    json.loads((out / "tokenizer.json").read_text())
    export(None, {**exporting, "adapter_name_or_path": str(out)})
    assert (merged / "model.safetensors").is_file()
    (out / "tokenizer.json").write_bytes(b"{")  # truncated after the fact: the marker's sizes tell
    with pytest.raises(ConfigError, match="tokenizer.json has 1 bytes, final_outputs.json says"):
        export(None, {**exporting, "adapter_name_or_path": str(out), "export_overwrite": True})


# `lmstack train <yaml>` SIGKILLed inside its final save: the adapter is written, the tokenizer is not
KILL_DRIVER = """
import os, sys, time
from pathlib import Path
from transformers import PreTrainedTokenizerBase
flag, out, original = Path(os.environ["FLAG"]), Path(os.environ["OUT"]), PreTrainedTokenizerBase.save_pretrained
def save_pretrained(self, save_directory, *args, **kwargs):
    if Path(save_directory) == out:
        flag.write_text(str(os.getpid()))
        time.sleep(600)
    return original(self, save_directory, *args, **kwargs)
PreTrainedTokenizerBase.save_pretrained = save_pretrained
from lmstack.cli.main import main
sys.exit(main(["train", sys.argv[1]]))
"""


def test_a_kill_inside_the_final_save_is_refused_by_export_and_finished_by_a_resume(cfg, tmp_path):
    import os
    import signal
    import sys
    import time

    import yaml

    out, flag = tmp_path / "run", tmp_path / "reached"
    run = {**cfg, "output_dir": str(out)}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    env = {**os.environ, "FLAG": str(flag), "OUT": str(out), "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[2] / "src"), env.get("PYTHONPATH", "")]
    )
    with (tmp_path / "killed.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", KILL_DRIVER, str(tmp_path / "run.yaml")], env=env, stdout=log, stderr=log
        )
        deadline = time.time() + 300  # a safety net only: the flag file is the event waited for
        while not flag.is_file():
            assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
            assert time.time() < deadline, "the final save was not reached"
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert (out / "adapter_model.safetensors").is_file() and (out / final_outputs.PENDING).is_file()
    exporting = {
        "model_name_or_path": cfg["model_name_or_path"],
        "template": "qwen",
        "export_dir": str(tmp_path / "m"),
    }
    with pytest.raises(ConfigError, match="its final save did not finish"):
        export(None, {**exporting, "adapter_name_or_path": str(out)})
    train(None, {**run, "resume_from_checkpoint": "auto"})
    assert final_outputs.incomplete(out) is None
    export(None, {**exporting, "adapter_name_or_path": str(out)})
