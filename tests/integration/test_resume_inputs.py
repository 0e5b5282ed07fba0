"""A resume refuses inputs that changed behind an unchanged config (tiny model, CPU): the files behind
a hub entry of dataset_info.json, the entry's `columns` mapping, the base model's tokenizer.json and
its weights replaced in place. Each is named in the refusal (exit 2, before a step is trained); the
unchanged inputs resume."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from lmstack.config.errors import ConfigError
from lmstack.reliability.checkpoint import verify_checkpoint
from lmstack.train.run import train

REPO = Path(__file__).resolve().parents[2]


def same_mtime(path: Path, write) -> bytes:
    """Rewrite `path` with `write(original bytes)`, keeping its mtime; returns the original bytes."""
    stat, original = path.stat(), path.read_bytes()
    path.write_bytes(write(original))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    return original


def perturbed(raw: bytes, path: Path) -> bytes:
    weights = load_file(path)
    torch.manual_seed(0)
    save_file({k: v + 0.01 * torch.randn_like(v.float()).to(v.dtype) for k, v in weights.items()}, path)
    return path.read_bytes()


def swapped_columns(raw: bytes) -> bytes:
    info = json.loads(raw)
    cols = info["hubset"]["columns"]
    cols["prompt"], cols["response"] = cols["response"], cols["prompt"]
    return json.dumps(info).encode()


def test_resume_refuses_changed_hub_data_columns_tokenizer_and_weights(base_cfg, tiny_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    data = tmp_path / "data"
    (data / "hubset").mkdir(parents=True)
    shutil.copy2(REPO / "data" / "alpaca_en_demo.json", data / "hubset" / "train.json")
    entry = {
        "hf_hub_url": str(data / "hubset"),
        "columns": {"prompt": "instruction", "query": "input", "response": "output"},
    }
    (data / "dataset_info.json").write_text(json.dumps({"hubset": entry}))
    run = {
        **base_cfg,
        "model_name_or_path": str(model),
        "dataset": "hubset",
        "dataset_dir": str(data),
        "max_samples": 24,
        "cutoff_len": 64,
        "max_steps": 2,
        "save_steps": 2,
        "output_dir": str(tmp_path / "run"),
    }
    train(None, run)
    out = Path(run["output_dir"])
    auto = {**run, "resume_from_checkpoint": "auto", "max_steps": 4}
    changes = [
        (
            data / "hubset" / "train.json",
            lambda raw: json.dumps(json.loads(raw)[::-1]).encode(),
            r"data file dataset:hubset/train\.json: \"[0-9a-f]+",
        ),
        (
            data / "dataset_info.json",
            swapped_columns,
            r'dataset entry dataset:hubset columns\.prompt: "instruction" -> "output"',
        ),
        (
            model / "tokenizer.json",
            lambda raw: json.dumps(json.loads(raw), indent=3).encode(),
            r"model_name_or_path tokenizer\.json: \"[0-9a-f]+",
        ),
        (
            model / "model.safetensors",
            lambda raw: perturbed(raw, model / "model.safetensors"),
            r"model_name_or_path model\.safetensors: \"size=\d+ header=",
        ),
    ]
    for path, write, named in changes:
        original = same_mtime(path, write)
        with pytest.raises(ConfigError, match=named) as err:
            train(None, auto)
        assert f"{out / 'checkpoint-2'} was trained with other settings" in str(err.value)
        assert "restore these settings and files" in str(err.value)
        assert not (out / "checkpoint-3").exists()  # refused before a step trained
        if path.name == "tokenizer.json":  # the CLI says it with exit 2
            from lmstack.cli.main import main

            yml = tmp_path / "auto.yaml"
            yml.write_text(yaml.safe_dump(auto))
            assert main(["train", str(yml)]) == 2
        path.write_bytes(original)
    train(None, auto)  # all restored: the same run resumes
    assert verify_checkpoint(out / "checkpoint-4") is None
