"""Gemma 3 and InternVL 3 (tiny models built here) train on LF's mllm_demo layout (two photos per
record) through `lmstack train` with their tiling options on (`image_do_pan_and_scan`,
`crop_to_patches`): the loss falls, the adapter reloads, and `lmstack chat` and the API answer on the
same photo with the prompt of the training record; the freeze_* switches decide which parts change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_api import start_api, stop_api
from test_api_vision import client, data_url, image_message
from test_vlm_lf_examples import write_lf_data

from lmstack.train.run import train

REPO = Path(__file__).resolve().parents[2]
FAMILIES = {"gemma3": ("gemma3", "image_do_pan_and_scan"), "internvl": ("intern_vl", "crop_to_patches")}
IMAGE_TOKEN = {"gemma3": "<image_soft_token>", "internvl": "<IMG_CONTEXT>"}
# image tokens of one 640 x 480 demo photo with the option on: Gemma 3, the photo + 2 pan-and-scan
# crops (ratio 1.33 >= 1.2; 320-pixel crops >= 256) x 4 tokens; InternVL, a 4 x 3 grid of 56-pixel
# tiles + the thumbnail x 4 tokens
TOKENS_ON = {"gemma3": 3 * 4, "internvl": 13 * 4}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from lmstack.tiny import build_tiny_vision_model

    root = tmp_path_factory.mktemp("tiny_tiled")
    return {f: build_tiny_vision_model(root / f, f, data_dir=REPO / "data") for f in FAMILIES}


@pytest.fixture
def lf_data(tmp_path) -> Path:
    return write_lf_data(tmp_path / "data")


def run_cfg(base_cfg, model: Path, family: str, data: Path, **overrides) -> dict:
    template, option = FAMILIES[family]
    return {
        **base_cfg,
        "model_name_or_path": str(model),
        "template": template,
        "dataset": "mllm_demo",
        "dataset_dir": str(data),
        "cutoff_len": 512,
        "per_device_train_batch_size": 2,
        "max_steps": 16,
        "learning_rate": 2e-2,
        option: True,
        **overrides,
    }


def losses(out: Path) -> list[float]:
    lines = (out / "trainer_log.jsonl").read_text().splitlines()
    return [json.loads(ln)["loss"] for ln in lines if "loss" in json.loads(ln)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora_on_lfs_mllm_demo_then_chat_and_api_answer_with_the_training_prompt(
    family, tiny, lf_data, base_cfg, tmp_path
):
    from peft import PeftModel
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from lmstack.config.load import build_config
    from lmstack.data.pipeline import build_datasets
    from lmstack.infer.engine import ChatEngine, load_infer_config
    from lmstack.infer.vision import session_for

    cfg = run_cfg(base_cfg, tiny[family], family, lf_data)
    train(None, cfg)
    out = Path(cfg["output_dir"])
    seen = losses(out)
    assert seen[-1] < 0.7 * seen[0], seen
    targets = json.loads((out / "adapter_config.json").read_text())["target_modules"]
    assert targets and all("language_model" in t for t in targets)  # LF's default: LoRA on the LM only
    assert AutoImageProcessor.from_pretrained(out) is not None  # the processor travels with the adapter
    model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(tiny[family]), out)
    assert sum("lora_A" in n for n, _ in model.named_parameters()) == len(targets)

    # the training prompt of record 0's first turn: its photo, with the option's crops / tiles
    infer = {k: cfg[k] for k in ("model_name_or_path", "template", "dataset_dir", FAMILIES[family][1])}
    infer.update(adapter_name_or_path=str(out), do_sample=False, max_new_tokens=6)
    engine = ChatEngine.from_config(load_infer_config(None, infer))
    question = "Who are they?"
    sample = build_datasets(build_config(cfg), engine.tokenizer, engine.template).train[0]
    prompt_len = next(i for i, label in enumerate(sample["labels"]) if label != -100)
    image_id = engine.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN[family])
    assert sample["input_ids"][:prompt_len].count(image_id) == TOKENS_ON[family]

    chat = session_for(engine)
    photo = lf_data / "mllm_demo_data" / "1.jpg"
    (note,) = chat.send(f"/image {photo}")
    assert note.startswith("[image 1 attached")
    (expected,) = chat.send(question)
    ids, extra = chat.vision.prompt([{"role": "user", "content": "<image>" + question}], chat.images)
    assert ids == sample["input_ids"][:prompt_len]  # the chat's prompt is the training prompt
    assert "pixel_values" in extra and not any(k in extra for k in ("num_crops", "num_patches"))

    url, proc = start_api(tmp_path, infer, "--model-name", "tiny", "--image-dir", str(lf_data))
    try:
        reply = client(url).chat.completions.create(
            model="tiny", messages=image_message(data_url(photo), question)
        )
    finally:
        stop_api(proc)
    assert reply.usage.prompt_tokens == prompt_len
    assert reply.choices[0].message.content == expected


def _changed(before: dict, after: dict, piece: str) -> bool:
    names = [n for n in before if piece in n]
    assert names, piece
    return any(not (before[n] == after[n]).all() for n in names)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize(
    "switches,trained",
    [
        ({}, {"language_model"}),  # LF's defaults: tower and projector frozen
        (
            {
                "freeze_vision_tower": False,
                "freeze_multi_modal_projector": False,
                "freeze_language_model": True,
            },
            {"vision_tower", "multi_modal_projector"},
        ),
    ],
)
def test_full_finetuning_trains_the_parts_lfs_freeze_keys_leave(
    switches, trained, family, tiny, lf_data, base_cfg
):
    from safetensors.torch import load_file

    cfg = run_cfg(base_cfg, tiny[family], family, lf_data, finetuning_type="full", max_steps=3, **switches)
    train(None, cfg)
    before = load_file(tiny[family] / "model.safetensors")
    after = load_file(Path(cfg["output_dir"]) / "model.safetensors")
    for part in ("language_model", "vision_tower", "multi_modal_projector"):
        assert _changed(before, after, part) is (part in trained), part


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_planned_chunked_cross_entropy_equals_the_models_own_loss(family, tiny, lf_data, base_cfg):
    """The run plan's chunked linear CE replaces these models' training forward too: the same loss,
    the crops / tiles (and Gemma 3's token types) going through the decoder."""
    import torch
    from transformers import AutoModelForImageTextToText

    from lmstack.config.load import build_config
    from lmstack.data.mm import media_spec
    from lmstack.data.mm_collate import MediaCollator
    from lmstack.data.pipeline import build_datasets
    from lmstack.models.kernels import apply_fused_ce
    from lmstack.models.load import load_tokenizer
    from lmstack.models.vision import load_image_processor
    from lmstack.templates import get_template

    cfg = build_config(run_cfg(base_cfg, tiny[family], family, lf_data))
    tok = load_tokenizer(cfg)
    data = build_datasets(cfg, tok, get_template(cfg.data.template, tok)).train
    spec = media_spec(cfg)
    image_id = tok.convert_tokens_to_ids(spec.tokens[1])
    batch = MediaCollator(tok.pad_token_id, spec, load_image_processor(cfg), image_id)([data[0], data[1]])
    model = AutoModelForImageTextToText.from_pretrained(tiny[family]).train()
    own = model(**batch).loss
    assert apply_fused_ce(model)
    chunked = model(**batch).loss
    torch.testing.assert_close(chunked, own, rtol=1e-5, atol=1e-5)
    other = dict(batch, pixel_values=torch.zeros_like(batch["pixel_values"]))
    assert not torch.allclose(model(**other).loss, chunked)  # the pixels are read


@pytest.mark.parametrize("family", list(FAMILIES))
def test_dpo_on_image_pairs_learns_the_preference(family, tiny, lf_data, base_cfg):
    """LF's rlhf_v layout (conversations + chosen / rejected + images): each row of a pair gets its
    photo's crops / tiles (and Gemma 3 its token types); policy = reference at step 1, then it learns."""
    cfg = run_cfg(
        base_cfg, tiny[family], family, lf_data, stage="dpo", dataset="rlhf_v",
        max_steps=12, learning_rate=1e-2, pref_beta=0.1,
    )  # fmt: skip
    train(None, cfg)
    seen = losses(Path(cfg["output_dir"]))
    assert seen[0] == pytest.approx(0.6931, abs=1e-3)
    assert seen[-1] < 0.5 * seen[0], seen
