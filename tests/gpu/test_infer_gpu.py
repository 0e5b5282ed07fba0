"""GPU: chat/api generation and export on CUDA (bf16). Run on the H200 with transformers 5.17 /
torch 2.11 on 2026-11-29: the stream's stopping criterion must live on the model's device."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lmstack.infer.engine import ChatEngine, load_infer_config
from lmstack.infer.export import export

pytestmark = pytest.mark.gpu
HELLO = [{"role": "user", "content": "Hello there"}]


def test_cuda_engine_streams_what_it_generates(tiny_model):
    cfg = {
        "model_name_or_path": str(tiny_model),
        "template": "qwen",
        "infer_dtype": "bfloat16",
        "do_sample": False,
        "max_new_tokens": 12,
    }
    engine = ChatEngine.from_config(load_infer_config(None, cfg))
    assert engine.model.device.type == "cuda" and engine.model.dtype == torch.bfloat16
    expected = engine.generate(HELLO)
    stream = engine.stream(HELLO)
    assert "".join(stream) == expected.text and stream.result == expected


def test_export_on_the_gpu_writes_bf16(tiny_model, tmp_path):
    out = tmp_path / "export"
    export(
        None,
        {
            "model_name_or_path": str(tiny_model),
            "template": "qwen",
            "finetuning_type": "full",
            "export_device": "auto",
            "infer_dtype": "bfloat16",
            "export_dir": str(out),
        },
    )
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16
