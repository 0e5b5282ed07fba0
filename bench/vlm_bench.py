"""Image SFT throughput on the GPU: a random-init model of the real Qwen2.5-VL-3B architecture (its
config: 36-layer 2048-wide language model, 32-block 1280-wide vision tower) on synthetic image
records in LF's mllm_demo layout, through lmstack's real `train` path. One RESULT line per run
(bench/lmstack_bench.py's steady-state timer: real tokens, vision tokens included, after step 10).

    python3 bench/vlm_bench.py assets ROOT            # ROOT/model (bf16 safetensors), ROOT/data
    python3 bench/vlm_bench.py run ROOT NAME [k=v ...] # one lmstack run (NAME: lora | full)
    python3 bench/vlm_bench.py yaml ROOT NAME [k=v ...] # that run's YAML on stdout
Random weights do not change throughput or memory. Call: PHASES=vlm bash bench/device.sh on the H200.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))

TEXT = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
    num_key_value_heads=2, max_position_embeddings=128000, rms_norm_eps=1e-6, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
)  # fmt: skip
VISION = dict(
    depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048, window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31], patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
)  # fmt: skip
SIZES = [(448, 448), (672, 448), (336, 336), (448, 672)]  # 256, 384, 144, 384 image tokens
RECORDS = 600
RUNS = {
    "lora": dict(finetuning_type="lora", lora_target="all", lora_rank=8, lora_alpha=16),
    "full": dict(finetuning_type="full"),  # vision tower and projector frozen (LF's defaults)
}
COMMON = dict(
    template="qwen2_vl", stage="sft", do_train=True, dataset="synth_mm", cutoff_len=2048,
    per_device_train_batch_size=8, max_steps=40, logging_steps=10, save_strategy="no", bf16=True,
    learning_rate=1e-4, report_to="none", seed=42, disable_tqdm=True, gradient_checkpointing=False,
    optim="adamw_torch_fused", dataloader_num_workers=6, overwrite_output_dir=True,
)  # fmt: skip


def build_assets(root: Path) -> None:
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig, Qwen2VLImageProcessor

    from lmstack.tiny import VISION_TOKENS, build_tokenizer, corpus_from_dir

    corpus = corpus_from_dir(REPO / "data")
    tok = build_tokenizer(corpus, 4096)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS["qwen2_5_vl"]})
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS["qwen2_5_vl"]}
    config = Qwen2_5_VLConfig(
        text_config=dict(TEXT, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None),
        vision_config=VISION,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    Qwen2VLImageProcessor().save_pretrained(root / "model")
    (root / "model" / "processor_config.json").write_text(
        json.dumps({"processor_class": "Qwen2_5_VLProcessor"})
    )
    data = root / "data"
    (data / "images").mkdir(parents=True, exist_ok=True)
    for i, (w, h) in enumerate(SIZES):
        grad = Image.linear_gradient("L").resize((w, h))
        Image.merge("RGB", (grad, grad.rotate(90), grad.rotate(180))).save(data / "images" / f"{i}.png")
    rng = random.Random(0)
    words = " ".join(corpus).split()
    records = []
    for i in range(RECORDS):
        ask = " ".join(rng.choices(words, k=rng.randint(20, 80)))
        answer = " ".join(rng.choices(words, k=rng.randint(40, 160)))
        records.append(
            {
                "messages": [{"role": "user", "content": f"<image>{ask}"}, {"role": "assistant", "content": answer}],
                "images": [f"images/{i % len(SIZES)}.png"],
            }
        )  # fmt: skip
    (data / "synth_mm.json").write_text(json.dumps(records))
    tags = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
    entry = {"file_name": "synth_mm.json", "formatting": "sharegpt", "tags": tags}
    entry["columns"] = {"messages": "messages", "images": "images"}
    (data / "dataset_info.json").write_text(json.dumps({"synth_mm": entry}))
    print(f"assets in {root}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters", flush=True)


def config(root: Path, name: str, overrides: list[str]) -> dict:
    cfg = dict(COMMON, **RUNS[name])
    cfg.update(
        model_name_or_path=str(root / "model"),
        dataset_dir=str(root / "data"),
        output_dir=f"/tmp/vlm_out_{name}",
    )
    for item in overrides:
        key, _, value = item.partition("=")
        cfg[key] = json.loads(value) if value[:1] in "0123456789-[{tf" and value not in ("true", "false") else (
            value == "true" if value in ("true", "false") else value
        )  # fmt: skip
    return cfg


def run(root: Path, name: str, overrides: list[str]) -> None:
    from lmstack_bench import lmstack_one

    lmstack_one(f"qwen2.5-vl-3b_{name}", config(root, name, overrides))


if __name__ == "__main__":
    verb, root = sys.argv[1], Path(sys.argv[2])
    if verb == "assets":
        build_assets(root)
    elif verb == "yaml":  # the run's YAML, for `lmstack plan` (the planner's prediction of the same run)
        import yaml

        print(yaml.safe_dump(config(root, sys.argv[3], sys.argv[4:])))
    else:
        run(root, sys.argv[3], sys.argv[4:])
