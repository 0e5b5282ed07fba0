from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from lmstack.memory import ModelSpec

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


FAST_PATH_CONFIGS = [
    dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
         num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
         num_attention_heads=32, num_key_value_heads=8),
    dict(model_type="llama", vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
         num_attention_heads=8, attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    dict(model_type="mistral", vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=2,
         num_attention_heads=16, num_key_value_heads=8),
    dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=2,
         num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    dict(model_type="qwen3", vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
         num_attention_heads=4, num_key_value_heads=2, head_dim=64, attention_bias=True),
]  # fmt: skip


@pytest.mark.parametrize("fields", FAST_PATH_CONFIGS, ids=lambda f: f"{f['model_type']}-{f['hidden_size']}")
def test_config_json_fast_path_counts_what_the_meta_model_counts(tmp_path, fields):
    """`lmstack plan` reads Llama-family specs from config.json alone (no torch import): the same spec,
    field for field, as the real transformers class built on the meta device."""
    from transformers import AutoConfig

    from lmstack.memory.model_spec import from_config_json

    (tmp_path / "config.json").write_text(json.dumps(fields))
    fast = from_config_json(tmp_path / "config.json")
    assert fast is not None
    assert fast == ModelSpec.from_config(AutoConfig.from_pretrained(str(tmp_path)))


def test_other_models_take_the_meta_path(tmp_path):
    from lmstack.memory.model_spec import from_config_json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64}))
    assert from_config_json(tmp_path / "config.json") is None
