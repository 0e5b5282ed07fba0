from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from lmstack.plan import ModelSpec

TINY = [
    Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False),
    LlamaConfig(vocab_size=300, hidden_size=96, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=6, num_key_value_heads=3, tie_word_embeddings=False),
]  # fmt: skip


def _real_lora_count(model: torch.nn.Module, rank: int, names: set[str] | None) -> int:
    total = 0
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Linear) and leaf != "lm_head" and (names is None or leaf in names):
            total += rank * (module.in_features + module.out_features)
    return total


@pytest.mark.parametrize("cfg", TINY, ids=["qwen2-tied", "qwen2-untied", "llama"])
def test_param_count_equals_real_model(cfg, tmp_path) -> None:
    torch.manual_seed(0)
    real = AutoModelForCausalLM.from_config(cfg)
    real.save_pretrained(tmp_path)  # writes config.json; read back through the real path
    spec = ModelSpec.from_pretrained_dir(tmp_path)
    assert spec.num_params == sum(p.numel() for p in real.parameters())
    assert spec.tie_word_embeddings == cfg.tie_word_embeddings
    assert spec.num_layers == cfg.num_hidden_layers
    assert spec.head_dim == cfg.hidden_size // cfg.num_attention_heads
    assert spec.decoder_layer_class.endswith("DecoderLayer")
    assert spec.largest_layer_params == cfg.vocab_size * cfg.hidden_size
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == spec.model_type
    for rank, target, names in [(8, "all", None), (16, ["q_proj", "v_proj"], {"q_proj", "v_proj"})]:
        assert spec.lora_params(rank, target) == _real_lora_count(real, rank, names)


@pytest.mark.parametrize(
    ("name", "params"),
    [("qwen2.5-0.5b", 494_032_768), ("qwen2.5-1.5b", 1_543_714_304), ("qwen2.5-7b", 7_615_616_512),
     ("llama-3-8b", 8_030_261_248), ("llama-2-70b", 68_976_648_192)],
)  # fmt: skip
def test_published_param_counts(specs, name: str, params: int) -> None:
    assert specs[name].num_params == params


def test_lora_matches_seed_example(specs) -> None:
    # seed 000 §4: Qwen2.5-3B r=8 all -> 14.97M; 0.5B r=16 all-linear by hand: 366,592 per layer.
    assert specs["qwen2.5-0.5b"].lora_params(16) == 366_592 * 24
    cfg3b = Qwen2Config(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                        num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    assert round(ModelSpec.from_config(cfg3b).lora_params(8) / 1e6, 2) == 14.97


def test_lora_target_errors_name_field(specs) -> None:
    with pytest.raises(ValueError, match=r"lora_target: got \['qkv'\]; allowed: all \| down_proj"):
        specs["qwen2.5-0.5b"].lora_params(8, ["qkv"])
    with pytest.raises(ValueError, match="lora_rank"):
        specs["qwen2.5-0.5b"].lora_params(0)
