"""flash_attn and enable_liger_kernel switches, and `lmstack env` (CPU paths; GPU paths in tests/gpu)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lmstack.cli.main import main
from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config
from lmstack.launch.context import LaunchContext
from lmstack.plan import decide
from lmstack.plan.runplan import RunPlan

CPU = LaunchContext()


def _gpu(*packages: str) -> LaunchContext:
    return dataclasses.replace(CPU, cuda=True, packages=frozenset(packages))


def test_flash_attn_auto_on_cpu_is_sdpa_and_says_why(base_cfg):
    cfg = build_config({**base_cfg, "flash_attn": "auto"})
    assert decide.attention(cfg, CPU, "cpu", False) == ("sdpa", "flash_attn: auto, CPU")
    plan = RunPlan.resolve(cfg, CPU)
    assert plan.attention == "sdpa" and plan.reasons["attention"] == "flash_attn: auto, CPU"


def test_flash_attn_auto_on_gpu_prefers_fa2_when_installed(base_cfg):
    cfg = build_config({**base_cfg, "flash_attn": "auto"})
    impl, reason = decide.attention(cfg, _gpu("flash_attn"), "cuda", False)
    assert impl == "flash_attention_2" and "flash-attn is installed" in reason
    impl, reason = decide.attention(cfg, _gpu(), "cuda", False)
    assert impl == "sdpa" and "flash-attn not installed" in reason


@pytest.mark.parametrize("value,impl", [("sdpa", "sdpa"), ("disabled", "eager")])
def test_flash_attn_explicit_values(base_cfg, value, impl):
    cfg = build_config({**base_cfg, "flash_attn": value})
    assert decide.attention(cfg, CPU, "cpu", False) == (impl, f"flash_attn: {value}")


def test_fa2_without_the_package_names_the_install(base_cfg):
    cfg = build_config({**base_cfg, "flash_attn": "fa2"})
    match = r"flash_attn: fa2 needs a CUDA GPU and the `flash_attn` package \(pip install flash-attn\)"
    with pytest.raises(ConfigError, match=match):
        decide.attention(cfg, CPU, "cpu", False)
    with pytest.raises(ConfigError, match=match):  # a GPU, but no flash_attn package
        decide.attention(cfg, _gpu(), "cuda", False)


def test_liger_missing_is_a_note_and_training_continues(base_cfg):
    cfg = build_config({**base_cfg, "enable_liger_kernel": True})
    use, reason = decide.liger(cfg, _gpu(), "cuda")
    assert use is False and "not installed" in reason and "pip install liger-kernel" in reason
    assert "continues without" in reason
    plan = RunPlan.resolve(cfg, _gpu())
    assert plan.liger is False and any("not installed" in n for n in plan.notes)


def test_liger_unsupported_family_is_a_note_and_training_continues(base_cfg, monkeypatch):
    pytest.importorskip("liger_kernel")
    monkeypatch.setattr(decide, "_model_type", lambda cfg: "no_such_family")
    cfg = build_config({**base_cfg, "enable_liger_kernel": True})
    use, reason = decide.liger(cfg, _gpu("liger_kernel"), "cuda")
    assert use is False and "no kernels for model type 'no_such_family'" in reason


def test_liger_off_does_nothing(base_cfg):
    cfg = build_config(base_cfg)
    assert decide.liger(cfg, CPU, "cpu") == (False, "enable_liger_kernel: false")
    plan = RunPlan.resolve(cfg, CPU)
    assert plan.liger is False and plan.notes == ()


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


def test_liger_on_cpu_is_a_note_and_training_continues(base_cfg):
    cfg = build_config({**base_cfg, "enable_liger_kernel": True})
    use, reason = decide.liger(cfg, CPU, "cpu")
    assert use is False and "need a CUDA GPU" in reason
    plan = RunPlan.resolve(cfg, CPU)
    assert plan.liger is False and any("need a CUDA GPU" in n for n in plan.notes)
