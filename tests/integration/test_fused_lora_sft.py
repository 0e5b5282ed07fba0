"""lora_kernel: fused vs peft on a real LoRA SFT run (tiny model, CPU fp32): the same losses, the same
saved adapter, loadable by PEFT; lora_dropout > 0 trains through the fused path and still equals PEFT."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmstack.models import fused_lora
from lmstack.train.run import train


def losses(out: Path) -> list[float]:
    rows = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines() if x.strip()]
    return [r["loss"] for r in rows if "loss" in r]


def run(cfg: dict, kernel: str, out: Path, monkeypatch) -> int:
    """Train with `lora_kernel: kernel`; returns how many LoRA Linear calls took the fused function."""
    calls = []
    real = fused_lora.fused_lora_linear

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fused_lora, "fused_lora_linear", counted)
    train(None, {**cfg, "lora_kernel": kernel, "output_dir": str(out)})
    plan = json.loads((out / "run_manifest.json").read_text())["plan"]
    assert plan["decisions"]["lora_kernel"] == kernel
    return len(calls)


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_fused_lora_sft_equals_peft(base_cfg, tiny_model, tmp_path, monkeypatch, dropout):
    cfg = {**base_cfg, "lora_dropout": dropout}
    assert run(cfg, "peft", tmp_path / "peft", monkeypatch) == 0
    # 2 layers x 7 linear modules, 4 steps x 1 micro-batch, forward only (the backward is the function's)
    assert run(cfg, "fused", tmp_path / "fused", monkeypatch) >= 2 * 7 * 4
    want, got = losses(tmp_path / "peft"), losses(tmp_path / "fused")
    assert len(got) == 4 and got[-1] < got[0]  # it trains
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    saved_peft = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    saved_fused = load_file(tmp_path / "fused" / "adapter_model.safetensors")
    assert saved_fused.keys() == saved_peft.keys() and len(saved_fused) == 2 * 7 * 2
    for key, tensor in saved_fused.items():
        torch.testing.assert_close(tensor, saved_peft[key], rtol=1e-4, atol=1e-6)

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    loaded = PeftModel.from_pretrained(base, tmp_path / "fused")  # PEFT's own loader, no lmstack code
    state = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert len(state) == len(saved_fused)
    for key, tensor in state.items():
        assert torch.equal(tensor, saved_fused[key.replace(".default", "")]), key


def test_resumed_dora_adapter_keeps_peft_under_auto_and_is_refused_under_fused(
    base_cfg, tiny_model, tmp_path
):
    """The plan cannot see that a resumed adapter is DoRA; the layers say so when they are wrapped."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lmstack.config.errors import ConfigError
    from lmstack.config.load import build_config
    from lmstack.models.adapters import setup_finetuning

    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_dora=True, task_type="CAUSAL_LM")
    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), config).save_pretrained(
        tmp_path / "dora"
    )
    cfg = {**base_cfg, "adapter_name_or_path": str(tmp_path / "dora")}
    model = setup_finetuning(build_config(cfg), AutoModelForCausalLM.from_pretrained(tiny_model), "fused")
    assert not any(hasattr(m, "_lmstack_peft_forward") for m in model.modules())  # PEFT computes DoRA
    with pytest.raises(ConfigError, match=r"lora_kernel: fused cannot compute LoRA layer .*q_proj.*variant"):
        setup_finetuning(
            build_config({**cfg, "lora_kernel": "fused"}),
            AutoModelForCausalLM.from_pretrained(tiny_model),
            "fused",
        )
