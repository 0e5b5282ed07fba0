"""`lmstack export` into a folder that holds an earlier export: the new export replaces the old one as
a whole (no stale weights file beside the new shards), and a SIGKILL at any point of the write leaves
the old export or the new one, each loading with plain transformers to its own weights."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from lmstack.config.errors import ConfigError
from lmstack.infer.export import export
from lmstack.reliability.atomic_dir import staging_dir

REPO = Path(__file__).resolve().parents[2]

# `lmstack export <yaml>` stopped for good at one point, the flag file written (the test SIGKILLs it):
#   tokenizer   the weights are written, the tokenizer is not (mid-write)
#   discard     the new export is in place, the old one is not yet deleted
DRIVER = """
import os, sys, time
from pathlib import Path
hook, flag = os.environ["HOOK"], Path(os.environ["FLAG"])
def reached(*args, **kwargs):
    flag.write_text(str(os.getpid()))
    time.sleep(600)
if hook == "tokenizer":
    from transformers import PreTrainedTokenizerBase
    PreTrainedTokenizerBase.save_pretrained = reached
else:
    from lmstack.reliability import atomic_dir
    atomic_dir._discard = reached
from lmstack.cli.main import main
sys.exit(main(["export", sys.argv[1]]))
"""


def tree(out: Path) -> dict[str, str]:
    return {
        p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def models(tiny_model, tmp_path_factory) -> tuple[Path, Path]:
    """The tiny model and a copy whose every weight differs (two full-finetuned runs to export)."""
    other = tmp_path_factory.mktemp("other") / "model"
    shutil.copytree(tiny_model, other)
    weights = load_file(other / "model.safetensors")
    torch.manual_seed(0)
    save_file(
        {k: v + 0.05 * torch.randn_like(v.float()).to(v.dtype) for k, v in weights.items()},
        other / "model.safetensors",
    )
    return tiny_model, other


def cfg(model: Path, out: Path, **extra) -> dict:
    return {
        "model_name_or_path": str(model),
        "template": "qwen",
        "finetuning_type": "full",
        "export_dir": str(out),
        **extra,
    }


def first_weight(folder: Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.model.embed_tokens.weight.detach().clone()


def test_reexport_as_shards_leaves_no_stale_single_file(models, tmp_path, caplog):
    old, new = models
    out = tmp_path / "export"
    export(None, cfg(old, out))
    (out / "notes.md").write_text("mine")
    caplog.set_level("INFO")
    export(None, cfg(new, out, export_size=0.0001, export_overwrite=True))
    assert not (out / "model.safetensors").exists()  # transformers would load it before the shards
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 2 and f"{len(shards)} shards" in caplog.text
    assert (out / "notes.md").read_text() == "mine"  # not the export's: carried over
    torch.testing.assert_close(first_weight(out), first_weight(new), rtol=0, atol=0)
    export(None, cfg(old, out, export_overwrite=True))  # and back to one file: no shard is left
    assert not list(out.glob("model-*.safetensors")) and not (out / "model.safetensors.index.json").exists()
    assert (out / "notes.md").read_text() == "mine"
    torch.testing.assert_close(first_weight(out), first_weight(old), rtol=0, atol=0)


def killed_export(conf: dict, tmp_path: Path, hook: str) -> None:
    import yaml

    yml, flag = tmp_path / f"{hook}.yaml", tmp_path / f"{hook}.reached"
    yml.write_text(yaml.safe_dump(conf))
    env = {**os.environ, "HOOK": hook, "FLAG": str(flag), "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    with (tmp_path / f"{hook}.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", DRIVER, str(yml)], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        deadline = time.time() + 240  # a safety net only: the flag file is the event waited for
        while not flag.is_file():
            assert proc.poll() is None, (tmp_path / f"{hook}.log").read_text()[-3000:]
            assert time.time() < deadline, "hook point not reached"
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)


@pytest.mark.parametrize("hook, expect", [("tokenizer", "old"), ("discard", "new")])
def test_kill_during_an_overwriting_export_leaves_one_whole_export(models, tmp_path, hook, expect):
    old, new = models
    out = tmp_path / "export"
    export(None, cfg(old, out))
    before = tree(out)
    killed_export(cfg(new, out, export_size=0.0001, export_overwrite=True), tmp_path, hook)
    if expect == "old":
        assert tree(out) == before  # not one file of the new export
        torch.testing.assert_close(first_weight(out), first_weight(old), rtol=0, atol=0)
    else:
        assert not (out / "model.safetensors").exists() and len(list(out.glob("model-*.safetensors"))) > 2
        torch.testing.assert_close(first_weight(out), first_weight(new), rtol=0, atol=0)
    assert staging_dir(out).exists()  # what the killed write left ...
    export(None, cfg(old, out, export_overwrite=True))
    assert not staging_dir(out).exists()  # ... is removed by the next export
    torch.testing.assert_close(first_weight(out), first_weight(old), rtol=0, atol=0)


@pytest.mark.parametrize("where", ["dataset_dir", "inside_model", "inside_adapter", "around_model"])
def test_export_dir_has_the_guards_of_output_dir(models, tmp_path, where):
    old, _ = models
    model, data, adapter = tmp_path / "models" / "base", tmp_path / "data", tmp_path / "adapter"
    shutil.copytree(old, model)
    shutil.copytree(REPO / "data", data)
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    targets = {
        "dataset_dir": (data, "is dataset_dir itself"),
        "inside_model": (model / "merged", "is inside model_name_or_path"),
        "inside_adapter": (adapter / "merged", "is inside adapter_name_or_path"),
        "around_model": (tmp_path / "models", "contains model_name_or_path"),
    }
    out, words = targets[where]
    conf = cfg(model, out, dataset_dir=str(data), dataset="alpaca_en_demo", export_overwrite=True)
    if where == "inside_adapter":
        conf.update(finetuning_type="lora", adapter_name_or_path=str(adapter))
    before = tree(tmp_path)
    with pytest.raises(
        ConfigError, match=f"export_dir: {re.escape(str(out))} {words}.*choose an export_dir outside"
    ):
        export(None, conf)
    assert tree(tmp_path) == before


def test_an_export_that_no_longer_verifies_is_refused_by_its_readers(models, tmp_path):
    from lmstack.infer.engine import check_inference, load_infer_config

    old, _ = models
    out = tmp_path / "export"
    export(None, cfg(old, out))
    (out / "README.md").write_text("model card")  # added afterwards: the user's, no problem
    reading = {"model_name_or_path": str(out), "template": "qwen", "finetuning_type": "full"}
    check_inference(load_infer_config(None, reading))
    raw = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(
        ConfigError, match=f"model_name_or_path: {out}: model.safetensors has {len(raw) // 2} bytes"
    ):
        check_inference(load_infer_config(None, reading))
