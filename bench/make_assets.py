"""Benchmark assets, identical to the team kit's (same generator calls, seed 0): a 16k-vocab BPE
tokenizer, random-init models with the real Qwen2.5 configs, and a synthetic alpaca set
(4,000 records, lognormal lengths, mean ~377 tokens) registered as `synth` in dataset_info.json.

Usage: python3 bench/make_assets.py ROOT qwen2.5-0.5b,qwen2.5-7b   (models are built on the GPU)
Random weights change neither throughput nor memory.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys

CONFIGS = {
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-3b": dict(
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
}
SYLLABLES = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "de", "an",
             "or", "el", "is", "un", "ba", "fe", "gi", "ho", "ju", "ve"]  # fmt: skip


def synthetic_records(n: int = 4000) -> list[dict]:
    """The kit's data, call for call: random.seed(0), a 30k-word vocabulary, then lognormal lengths."""
    random.seed(0)
    words = list(
        {"".join(random.choice(SYLLABLES) for _ in range(random.randint(1, 4))) for _ in range(30000)}
    )

    def text(k: int) -> str:
        return " ".join(random.choice(words) for _ in range(k))

    def lognorm(median: float, sigma: float, lo: int, hi: int) -> int:
        return int(min(hi, max(lo, random.lognormvariate(math.log(median), sigma))))

    return [
        {
            "instruction": text(lognorm(50, 0.8, 4, 600)),
            "input": "",
            "output": text(lognorm(220, 0.9, 8, 1800)),
        }
        for _ in range(n)
    ]


def write_dataset(root: str, records: list[dict]) -> None:
    os.makedirs(f"{root}/data", exist_ok=True)
    with open(f"{root}/data/synth.json", "w") as fh:
        json.dump(records, fh)
    info = {
        "synth": {
            "file_name": "synth.json",
            "formatting": "alpaca",
            "columns": {"prompt": "instruction", "query": "input", "response": "output"},
        }
    }
    with open(f"{root}/data/dataset_info.json", "w") as fh:
        json.dump(info, fh)


def train_tokenizer(records: list[dict]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=16000,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([r["instruction"] + " " + r["output"] for r in records[:1500]], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def qwen_config(arch: str):
    """The real Qwen2.5 config of `arch` (shapes, RoPE, norm eps, bf16)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        torch_dtype="bfloat16",
        **CONFIGS[arch],
    )


def build_model(root: str, arch: str, tokenizer) -> None:
    import torch
    from transformers import Qwen2ForCausalLM

    out = f"{root}/{arch}"
    if os.path.exists(f"{out}/config.json"):
        return
    config = qwen_config(arch)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print("built", arch, round(sum(p.numel() for p in model.parameters()) / 1e9, 3), "B params", flush=True)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(root: str, archs: list[str]) -> None:
    unknown = [a for a in archs if a not in CONFIGS]
    if unknown:
        sys.exit(f"unknown arch {unknown}; known: {', '.join(CONFIGS)}")
    records = synthetic_records()
    write_dataset(root, records)
    tokenizer = train_tokenizer(records)
    lengths = [
        len(tokenizer(r["instruction"]).input_ids) + len(tokenizer(r["output"]).input_ids)
        for r in records[:500]
    ]
    print("mean tokens/sample", sum(lengths) / len(lengths), "max", max(lengths), flush=True)
    for arch in archs:
        build_model(root, arch, tokenizer)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","))
