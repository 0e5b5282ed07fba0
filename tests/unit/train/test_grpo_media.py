"""Image prompts of stage grpo (train/grpo_media.py): the conversational prompt TRL's vision path gets is
rendered back by ImagePromptProcessor to exactly the ids the sft multimodal plugin encoded (data/mm.py),
and its pixels are the sft collator's (data/mm_collate.py) for the same images."""

from __future__ import annotations

import json

import pytest
import torch

from lmstack.config.load import build_config
from media_files import image_demo_dir


@pytest.mark.parametrize("family,template", [("qwen2_5_vl", "qwen2_vl"), ("qwen3_vl", "qwen3_vl_nothink")])
def test_image_prompts_render_to_the_sft_plugins_ids_and_pixels(family, template, tmp_path):
    from trl.data_utils import prepare_multimodal_messages

    from lmstack.data.mm import media_spec
    from lmstack.data.mm_collate import MediaCollator
    from lmstack.data.pipeline import build_datasets
    from lmstack.models.vision import load_image_processor
    from lmstack.tiny import build_tiny_vision_model
    from lmstack.train import common, grpo_media

    model = build_tiny_vision_model(tmp_path / family, family)
    cfg = build_config(
        {
            "model_name_or_path": str(model),
            "template": template,
            "stage": "grpo",
            "reward_funcs": "length",
            "dataset": "mllm_demo",
            "dataset_dir": str(image_demo_dir(tmp_path / "data")),
            "cutoff_len": 256,
            "output_dir": str(tmp_path / "out"),
        }
    )
    tokenizer, tmpl = common.tokenizer_and_template(cfg)
    spec = media_spec(cfg)
    rows = list(build_datasets(cfg, tokenizer, tmpl).train)
    processor = grpo_media.rollout_processor(cfg, spec, tokenizer)
    columns = [
        grpo_media.row_columns(r, tokenizer.decode(r["input_ids"], skip_special_tokens=False), spec)
        for r in rows
    ]
    prompts = [prepare_multimodal_messages(c["prompt"], images=c["images"]) for c in columns]
    assert all(sum(p["type"] == "image" for p in m[0]["content"]) == 1 for m in prompts)

    # generation: TRL's _tokenize_prompts call
    out = processor.apply_chat_template(
        conversation=prompts, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    assert out["input_ids"] == [r["input_ids"] for r in rows]  # the sft plugin's expansion, token for token
    collated = MediaCollator(
        tokenizer.pad_token_id, spec, load_image_processor(cfg), processor.image_token_id
    )([{"input_ids": r["input_ids"], "labels": r["input_ids"], "images": r["images"]} for r in rows])
    torch.testing.assert_close(out["pixel_values"], collated["pixel_values"])
    torch.testing.assert_close(out["image_grid_thw"], collated["image_grid_thw"])

    # the log-prob forwards: TRL renders to text, then calls the processor with the images
    texts = [processor.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    images = [c["images"] for c in columns]
    inputs = processor(images=images, text=texts, padding=True, return_tensors="pt")
    width = max(len(r["input_ids"]) for r in rows)
    for i, r in enumerate(rows):  # left-padded, as TRL pads its prompt ids
        assert inputs["input_ids"][i, width - len(r["input_ids"]) :].tolist() == r["input_ids"]
        assert inputs["attention_mask"][i].sum() == len(r["input_ids"])
    torch.testing.assert_close(inputs["pixel_values"], collated["pixel_values"])
    if "mm_token_type_ids" in inputs:
        assert (inputs["mm_token_type_ids"] == (inputs["input_ids"] == processor.image_token_id)).all()
    assert json.loads(rows[0]["images"])  # the pipeline kept the image paths for the rollout
