"""A model folder lmstack cannot train from is refused before anything loads, in train, check and plan."""

from __future__ import annotations

import shutil

import pytest
import yaml

from lmstack.cli.main import main


@pytest.fixture
def no_tokenizer(tiny_model, tmp_path):
    dst = tmp_path / "notok"
    dst.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model / name, dst / name)
    return dst


@pytest.mark.parametrize("command", ["train", "check", "plan"])
def test_a_folder_without_tokenizer_files_is_refused(
    command, base_cfg, no_tokenizer, tmp_path, capsys, monkeypatch
):
    import lmstack.models.load as load

    monkeypatch.setattr(load, "load_tokenizer", lambda cfg: pytest.fail("the tokenizer loaded"))
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({**base_cfg, "model_name_or_path": str(no_tokenizer)}))
    assert main([command, str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{no_tokenizer} has no tokenizer files" in err
    assert "tokenizer.json" in err and "point model_name_or_path at the full model" in err


def test_eval_strategy_without_eval_data_is_refused_before_the_model_loads(base_cfg, tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({**base_cfg, "eval_strategy": "steps", "eval_steps": 2}))
    for command in ("train", "check"):
        assert main([command, str(path)]) == 2
        assert "eval_strategy: steps needs evaluation data; set val_size" in capsys.readouterr().err


def test_deepspeed_on_a_machine_without_a_gpu_is_refused(base_cfg, tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible")
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({**base_cfg, "deepspeed": "ds_z2_config.json"}))
    assert main(["train", str(path)]) == 2
    assert "needs a CUDA GPU and this machine has none" in capsys.readouterr().err
