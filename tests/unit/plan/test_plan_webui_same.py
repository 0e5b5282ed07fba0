"""The web UI's plan and `lmstack plan cfg.yaml --gpus G --gpu-memory M` plan the same YAML the same way:
the same table and the same recommended YAML changes, whatever this machine has installed (DeepSpeed is
assumed on the target by both, and both read the data's own row lengths)."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from lmstack.cli.main import main
from lmstack.models.load import TOKENIZER_FILES
from lmstack.webui.actions import plan_table

LLAMA2_70B = dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8)  # fmt: skip


@pytest.fixture
def llama70b(tmp_path, tiny_model):
    """A 70B config.json with a real (tiny) tokenizer beside it: planned from config.json alone."""
    d = tmp_path / "llama-2-70b"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], **LLAMA2_70B})
    )
    for name in (*TOKENIZER_FILES, "tokenizer_config.json", "merges.txt", "special_tokens_map.json"):
        if (tiny_model / name).is_file():
            shutil.copy(tiny_model / name, d / name)
    return str(d)


def packed_70b(llama70b, tmp_path, finetuning_type: str) -> dict:
    return dict(model_name_or_path=llama70b, stage="sft", template="llama2", dataset="alpaca_en_demo",
                cutoff_len=2048, packing=True, output_dir=str(tmp_path / "out"), per_device_train_batch_size=1,
                gradient_accumulation_steps=8, bf16=True, finetuning_type=finetuning_type)  # fmt: skip


@pytest.mark.parametrize(
    "case, gpus, gib",
    [("full-70b", 8, 80.0), ("lora-70b", 1, 80.0), ("lora-tiny-unpacked", 1, 24.0)],
)
def test_web_ui_plan_is_lmstack_plan(case, gpus, gib, llama70b, base_cfg, tmp_path, capsys):
    flat = base_cfg if case == "lora-tiny-unpacked" else packed_70b(llama70b, tmp_path, case.split("-")[0])
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(flat))
    argv = ["plan", str(path), "--gpus", str(gpus), "--gpu-memory", f"{gib:g}"]
    capsys.readouterr()
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert main([*argv, "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)["recommendation"]
    table, changes = plan_table(dict(flat), gpus, gib)
    assert table + "\n" == printed
    assert changes == (rec["yaml_changes"] if rec else {})
    if case == "full-70b":  # ZeRO-3 on 8 x 80 GB, whether or not DeepSpeed is installed here
        assert changes["deepspeed"].startswith("z3")
