"""flash_attn and enable_liger_kernel switches, and `lmstack env` (CPU paths; GPU paths in tests/gpu)."""

from __future__ import annotations

import importlib.util
import json
import logging
from types import SimpleNamespace

import pytest

from lmstack.cli.main import main
from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config
from lmstack.models import load as model_load


def test_flash_attn_auto_on_cpu_is_sdpa_and_logged(base_cfg, caplog):
    cfg = build_config({**base_cfg, "flash_attn": "auto"})
    with caplog.at_level(logging.INFO):
        assert model_load.attention_implementation(cfg, "cpu") == "sdpa"
    assert "flash_attn: auto -> sdpa (CPU)" in caplog.text


def test_flash_attn_auto_on_gpu_prefers_fa2_when_installed(base_cfg, monkeypatch):
    cfg = build_config({**base_cfg, "flash_attn": "auto"})
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else None
    )
    assert model_load.attention_implementation(cfg, "cuda") == "flash_attention_2"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert model_load.attention_implementation(cfg, "cuda") == "sdpa"


@pytest.mark.parametrize("value,impl", [("sdpa", "sdpa"), ("disabled", "eager")])
def test_flash_attn_explicit_values(base_cfg, value, impl):
    assert model_load.attention_implementation(build_config({**base_cfg, "flash_attn": value}), "cpu") == impl


def test_fa2_without_the_package_names_the_install(base_cfg):
    cfg = build_config({**base_cfg, "flash_attn": "fa2"})
    with pytest.raises(
        ConfigError,
        match=r"flash_attn: fa2 needs a CUDA GPU and the `flash_attn` package \(pip install flash-attn\)",
    ):
        model_load.attention_implementation(cfg, "cpu")


def _model(model_type: str):
    return SimpleNamespace(config=SimpleNamespace(model_type=model_type))


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is not None, reason="liger-kernel installed")
def test_liger_missing_warns_and_continues(base_cfg, caplog):
    cfg = build_config({**base_cfg, "enable_liger_kernel": True})
    assert model_load.apply_liger_kernel(cfg, _model("qwen2")) is False
    assert "pip install liger-kernel" in caplog.text and "continues without" in caplog.text


def test_liger_unsupported_family_warns_and_continues(base_cfg, caplog):
    pytest.importorskip("liger_kernel")
    cfg = build_config({**base_cfg, "enable_liger_kernel": True})
    assert model_load.apply_liger_kernel(cfg, _model("no_such_family")) is False
    assert "no kernels for model type 'no_such_family'" in caplog.text


def test_liger_off_does_nothing(base_cfg, caplog):
    assert model_load.apply_liger_kernel(build_config(base_cfg), _model("qwen2")) is False
    assert caplog.text == ""


def test_lmstack_env_on_cpu(capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for name in (
        "python:",
        "torch:",
        "transformers:",
        "peft:",
        "trl:",
        "accelerate:",
        "deepspeed:",
        "liger-kernel:",
        "bitsandbytes:",
        "datasets:",
        "lmstack:",
    ):
        assert name in out, name
    assert "no GPU visible" in out
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["gpus"] == [] and report["versions"]["torch"] and "allreduce" not in report


def test_liger_on_cpu_warns_and_continues(base_cfg, caplog):
    cfg = build_config({**base_cfg, "enable_liger_kernel": True})
    assert model_load.apply_liger_kernel(cfg, _model("qwen2"), "cpu") is False
    assert "need a CUDA GPU" in caplog.text
