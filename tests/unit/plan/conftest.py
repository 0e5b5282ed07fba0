"""Model specs for the planner tests: real transformers configs built on the meta device."""

from __future__ import annotations

import json

import pytest
from transformers import GPT2Config, LlamaConfig, Qwen2Config

from lmstack.memory import ModelSpec

QWEN_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
QWEN_15B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
QWEN_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)  # fmt: skip
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8)  # fmt: skip
LLAMA_13B = dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                 num_attention_heads=40)  # fmt: skip
LLAMA2_70B = dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8)  # fmt: skip
LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32)  # fmt: skip


@pytest.fixture(scope="session")
def qwen_shapes() -> dict[str, dict]:
    """Qwen2.5 config fields by size, for tests that write a config.json."""
    return {"0.5b": QWEN_05B, "1.5b": QWEN_15B, "7b": QWEN_7B}


@pytest.fixture
def qwen(tmp_path, qwen_shapes):
    """make(size): a config.json-only Qwen2.5 folder of that size (the path `lmstack plan` reads)."""

    def make(size: str) -> str:
        d = tmp_path / f"qwen2.5-{size}"
        if not d.exists():
            d.mkdir()
            body = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **qwen_shapes[size]}
            (d / "config.json").write_text(json.dumps(body))
        return str(d)

    return make


@pytest.fixture(scope="session")
def specs() -> dict[str, ModelSpec]:
    return {
        "qwen2.5-0.5b": ModelSpec.from_config(Qwen2Config(**QWEN_05B)),
        "qwen2.5-1.5b": ModelSpec.from_config(Qwen2Config(**QWEN_15B)),
        "qwen2.5-7b": ModelSpec.from_config(Qwen2Config(**QWEN_7B)),
        "llama-3-8b": ModelSpec.from_config(LlamaConfig(**LLAMA3_8B)),
        "llama-13b": ModelSpec.from_config(LlamaConfig(**LLAMA_13B)),
        "llama-2-70b": ModelSpec.from_config(LlamaConfig(**LLAMA2_70B)),
        "llama-2-7b": ModelSpec.from_config(LlamaConfig(**LLAMA2_7B)),
        "gpt3-175b": ModelSpec.from_config(
            GPT2Config(n_positions=2048, n_embd=12288, n_layer=96, n_head=96, vocab_size=50257)
        ),
    }


@pytest.fixture
def kept_per_token(live_bytes):
    """probe(path, fp32=False, **yaml): bytes per token live when the final norm starts (what the decoder layers
    leave for the backward) in one freeze-tuning step without checkpointing, 2 rows of 256 tokens, the model set
    up by lmstack's own code (RunPlan, setup_finetuning, the chunked CE) and loaded in bf16 (optimizer-held
    masters) or fp32 (classic AMP) under bf16 autocast like the Trainer's."""
    import torch
    from transformers import AutoModelForCausalLM

    from lmstack.config.load import build_config
    from lmstack.launch.context import LaunchContext
    from lmstack.models.adapters import setup_finetuning
    from lmstack.models.kernels import apply_training_kernels
    from lmstack.plan.runplan import RunPlan

    def probe(path, fp32: bool = False, **yaml_kw) -> float:
        from dataclasses import replace

        yaml = dict(output_dir="o", template="qwen", stage="sft", finetuning_type="freeze", bf16=True,
                    model_name_or_path=str(path), **yaml_kw)  # fmt: skip
        p = replace(RunPlan.resolve(build_config(yaml), LaunchContext()), checkpointing=False)
        torch.manual_seed(0)
        dtype = torch.float32 if fp32 else torch.bfloat16
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
        assert apply_training_kernels("chunked", model) == "chunked"
        model = setup_finetuning(p.cfg, model)
        model.train()
        tracker, kept = live_bytes(model), []
        model.get_decoder().norm.register_forward_pre_hook(lambda _, args: kept.append(tracker.live))
        ids = torch.randint(3, model.config.vocab_size, (2, 256))
        with tracker.mode:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(input_ids=ids, labels=ids).loss.backward()
        return kept[0] / ids.numel()

    return probe
