"""GPU, in an environment with Unsloth installed (bench/call_*.sh installs it in its own target):
`use_unsloth: true` trains through the real Unsloth package, and Unsloth's model keeps packed
documents apart the way lmstack's packed rows need (position_ids restarting at 0, no attention mask)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("unsloth") is None, reason="unsloth not installed"),
]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> Path:
    """A Qwen2 model with head_dim 64 (Unsloth's kernels expect real head sizes)."""
    from lmstack.tiny import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("uns") / "qwen2",
        data_dir=REPO / "data",
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
    )


def test_use_unsloth_trains_through_unsloth_and_saves_a_peft_adapter(small_model, tmp_path):
    out = tmp_path / "out"
    cfg = {
        "model_name_or_path": str(small_model), "template": "qwen", "stage": "sft", "do_train": True,
        "finetuning_type": "lora", "lora_target": "all", "dataset": "alpaca_en_demo",
        "dataset_dir": str(REPO / "data"), "cutoff_len": 256, "output_dir": str(out), "bf16": True,
        "per_device_train_batch_size": 4, "learning_rate": 5e-3, "max_steps": 20, "logging_steps": 1,
        "save_strategy": "no", "report_to": "none", "use_unsloth": True, "packing": True,
    }  # fmt: skip
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "lmstack.cli", "train", str(path)], capture_output=True,
                          text=True, timeout=400)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "through Unsloth's FastLanguageModel" in proc.stderr
    rows = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines() if x.strip()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 20 and sum(losses[-5:]) < sum(losses[:5]), losses
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(small_model, dtype=torch.bfloat16)
    model = PeftModel.from_pretrained(base, out)
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in model.named_parameters())


def test_unsloth_keeps_packed_documents_apart(small_model):
    """Two documents in one row (position_ids restart) give each document the logits it has alone."""
    import torch
    from unsloth import FastLanguageModel

    model, _ = FastLanguageModel.from_pretrained(model_name=str(small_model), max_seq_length=256,
                                                 dtype=torch.bfloat16, load_in_16bit=True, load_in_4bit=False,
                                                 use_gradient_checkpointing=False)  # fmt: skip
    model = FastLanguageModel.get_peft_model(model, r=8, target_modules=["q_proj", "v_proj"], lora_alpha=16)
    model.train()
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(5, 1000, (1, n), generator=g).cuda() for n in (40, 56))
    row = torch.cat([a, b], 1)
    pos = torch.cat([torch.arange(40), torch.arange(56)]).unsqueeze(0).cuda()
    with torch.no_grad():
        packed = model(input_ids=row, position_ids=pos).logits.float()
        alone = model(input_ids=b).logits.float()
    err = (packed[:, 40:] - alone).abs().max().item()
    assert err < 0.05 * alone.abs().max().item(), f"document 2 sees document 1 (max |diff| {err})"
