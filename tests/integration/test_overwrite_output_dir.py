"""overwrite_output_dir removes what an earlier lmstack run wrote into output_dir (checkpoints, the adapter
or model, tokenizer files, logs, plots, manifests: the record of its final save), keeps anyone else's
files and says what it removed; a LoRA run then a full run into one folder leaves the full model only,
and `chat` / `export` on the full YAML work. A folder that still holds two runs' outputs (written before
the record existed) is refused with a hint that, followed, works."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from cli_run import lmstack

REPO = Path(__file__).resolve().parents[2]
ADAPTER = ("adapter_config.json", "adapter_model.safetensors")




@pytest.fixture
def yamls(base_cfg, tmp_path) -> tuple[Path, Path, Path]:
    """(LoRA YAML, full YAML with overwrite_output_dir, output_dir): one folder for both runs."""
    out = tmp_path / "out"
    common = {**base_cfg, "output_dir": str(out), "max_steps": 2, "save_steps": 2, "max_samples": 16}
    common["max_new_tokens"] = 4
    lora, full = tmp_path / "lora.yaml", tmp_path / "full.yaml"
    lora.write_text(yaml.safe_dump(common))
    full.write_text(yaml.safe_dump({**common, "finetuning_type": "full", "overwrite_output_dir": True}))
    return lora, full, out


def train(path: Path, cwd: Path) -> subprocess.CompletedProcess:
    done = lmstack("train", str(path), cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_an_overwriting_full_run_removes_the_earlier_lora_outputs_and_keeps_foreign_files(yamls, tmp_path):
    lora, full, out = yamls
    train(lora, tmp_path)
    assert all((out / name).is_file() for name in ADAPTER)
    (out / "notes.txt").write_text("mine")  # a file lmstack did not write
    done = train(full, tmp_path)
    removed = next(x for x in done.stderr.splitlines() if "removed from" in x)
    for name in (*ADAPTER, "checkpoint-2", "README.md", "trainer_log.jsonl", "tokenizer.json"):
        assert name in removed, removed
    left = [x for x in done.stderr.splitlines() if "left in" in x]
    assert len(left) == 1 and "notes.txt" in left[0] and "adapter" not in left[0], left
    assert not any((out / name).exists() for name in ADAPTER)
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    chat = lmstack("chat", str(full), cwd=tmp_path, stdin="hi\n")
    assert chat.returncode == 0, chat.stderr[-3000:]
    assert "loading the full-finetuned model trained in output_dir" in chat.stderr
    export = lmstack("export", str(full), f"export_dir={tmp_path / 'merged'}", cwd=tmp_path)
    assert export.returncode == 0, export.stderr[-3000:]
    assert (tmp_path / "merged" / "model.safetensors").is_file()


def test_two_runs_outputs_in_one_folder_get_a_hint_that_works(yamls, tmp_path):
    lora, full, out = yamls
    train(lora, tmp_path)
    (out / "lmstack_outputs.json").unlink()  # as a folder written before the record existed
    train(full, tmp_path)
    assert all((out / name).is_file() for name in ADAPTER)  # unknown to the cleanup: kept
    for command in ("chat", "export"):
        refused = lmstack(command, str(full), cwd=tmp_path, stdin="hi\n")
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert "the outputs of two runs" in refused.stderr
        assert (
            "the last run was finetuning_type: full, so the adapter is left from an earlier run"
            in refused.stderr
        )
        assert "delete adapter_config.json, adapter_model.safetensors" in refused.stderr
        assert "set finetuning_type: lora" not in refused.stderr  # that would load the stale adapter
    for name in ADAPTER:  # the hint, followed
        (out / name).unlink()
    chat = lmstack("chat", str(full), cwd=tmp_path, stdin="hi\n")
    assert chat.returncode == 0, chat.stderr[-3000:]
    assert "loading the full-finetuned model trained in output_dir" in chat.stderr
