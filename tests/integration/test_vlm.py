"""LF's multimodal demo data (mllm_demo.json: sharegpt messages + images) trains on the tiny vision
models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL dense and MoE, LLaVA) through `lmstack train` (the real
Trainer): the loss falls, the adapter is saved and reloads, and the freeze_* switches decide which
parts change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmstack.train.run import train

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 220), "yellow": (230, 220, 40)}
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "llava")
TEMPLATES = {"llava": "llava", "qwen3_vl": "qwen3_vl_nothink", "qwen3_vl_moe": "qwen3_vl_nothink"}


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    from lmstack.tiny import build_tiny_vision_model

    root = tmp_path_factory.mktemp("tiny_vlm")
    data = Path(__file__).resolve().parents[2] / "data"
    return {f: build_tiny_vision_model(root / f, f, data_dir=data) for f in FAMILIES}


@pytest.fixture
def mllm_demo(tmp_path) -> Path:
    """LF's mllm_demo layout: dataset_info.json, mllm_demo.json, mllm_demo_data/<n>.png."""
    from PIL import Image

    folder = tmp_path / "data"
    (folder / "mllm_demo_data").mkdir(parents=True)
    records = []
    for i, (name, rgb) in enumerate(COLOURS.items()):
        Image.new("RGB", (64 + 16 * i, 48), rgb).save(folder / "mllm_demo_data" / f"{i}.png")
        records.append(
            {
                "messages": [
                    {"role": "user", "content": "<image>What colour is this picture?"},
                    {"role": "assistant", "content": f"The picture is {name}."},
                ],
                "images": [f"mllm_demo_data/{i}.png"],
            }
        )
    (folder / "mllm_demo.json").write_text(json.dumps(records))
    tags = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
    entry = {"file_name": "mllm_demo.json", "formatting": "sharegpt", "tags": tags}
    entry["columns"] = {"messages": "messages", "images": "images"}
    (folder / "dataset_info.json").write_text(json.dumps({"mllm_demo": entry}))
    return folder


def vlm_run(base_cfg, model: Path, family: str, data: Path, **overrides) -> dict:
    return {
        **base_cfg,
        "model_name_or_path": str(model),
        "template": TEMPLATES.get(family, "qwen2_vl"),
        "dataset": "mllm_demo",
        "dataset_dir": str(data),
        "cutoff_len": 256,
        "per_device_train_batch_size": 2,
        "max_steps": 16,
        "learning_rate": 2e-2,
        **overrides,
    }


def losses(out: Path) -> list[float]:
    lines = (out / "trainer_log.jsonl").read_text().splitlines()
    return [json.loads(ln)["loss"] for ln in lines if "loss" in json.loads(ln)]


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_on_mllm_demo_loss_falls_adapter_reloads_vision_tower_untouched(
    family, tiny_vlm, mllm_demo, base_cfg
):
    from peft import PeftModel
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    cfg = vlm_run(base_cfg, tiny_vlm[family], family, mllm_demo)
    train(None, cfg)
    out = Path(cfg["output_dir"])
    seen = losses(out)
    assert seen[-1] < 0.7 * seen[0], seen
    targets = json.loads((out / "adapter_config.json").read_text())["target_modules"]
    assert targets and not any(
        k in t for t in targets for k in ("visual", "vision_tower", "merger", "projector")
    )
    assert all("language_model" in t for t in targets)  # LoRA on the language model only (LF's default)
    assert AutoImageProcessor.from_pretrained(out) is not None  # the processor travels with the adapter
    base = AutoModelForImageTextToText.from_pretrained(tiny_vlm[family])
    model = PeftModel.from_pretrained(base, out)
    assert sum("lora_A" in n for n, _ in model.named_parameters()) == len(targets)


def _changed(before: dict, after: dict, piece: str) -> bool:
    names = [n for n in before if piece in n]
    assert names, piece
    return any(not (before[n] == after[n]).all() for n in names)


@pytest.mark.parametrize(
    "switches,vision_changes,projector_changes",
    [({}, False, False), ({"freeze_vision_tower": False, "freeze_multi_modal_projector": False}, True, True)],
)
def test_full_finetuning_trains_the_parts_the_freeze_switches_leave(
    switches, vision_changes, projector_changes, tiny_vlm, mllm_demo, base_cfg
):
    from safetensors.torch import load_file

    model = tiny_vlm["llava"]
    cfg = vlm_run(base_cfg, model, "llava", mllm_demo, finetuning_type="full", max_steps=3, **switches)
    train(None, cfg)
    before = load_file(model / "model.safetensors")
    after = load_file(Path(cfg["output_dir"]) / "model.safetensors")
    assert _changed(before, after, "language_model")
    assert _changed(before, after, "vision_tower") is vision_changes
    assert _changed(before, after, "multi_modal_projector") is projector_changes


@pytest.mark.parametrize("unfreeze", [False, True])
def test_qwen3_vl_full_finetuning_freezes_lfs_vision_keys_with_the_deepstack_mergers(
    unfreeze, tiny_vlm, mllm_demo, base_cfg
):
    """LF's Qwen3-VL parts: the vision tower is pos_embed, patch_embed, blocks and the DeepStack
    mergers; the projector the final merger. LF's qwen3vl_full_sft switches (tower and projector frozen)
    train the language model only; unfrozen, every part changes."""
    from safetensors.torch import load_file

    model = tiny_vlm["qwen3_vl"]
    switches = {"freeze_vision_tower": not unfreeze, "freeze_multi_modal_projector": not unfreeze}
    cfg = vlm_run(
        base_cfg, model, "qwen3_vl", mllm_demo, finetuning_type="full", max_steps=3,
        freeze_language_model=False, **switches,
    )  # fmt: skip
    train(None, cfg)
    before = load_file(model / "model.safetensors")
    after = load_file(Path(cfg["output_dir"]) / "model.safetensors")
    assert _changed(before, after, "language_model.layers")
    for piece in ("visual.pos_embed", "visual.patch_embed", "visual.blocks", "visual.deepstack_merger_list"):
        assert _changed(before, after, piece) is unfreeze, piece
    assert _changed(before, after, "visual.merger.") is unfreeze


def test_freeze_language_model_keeps_it_and_lora_goes_to_the_unfrozen_vision_tower(
    tiny_vlm, mllm_demo, base_cfg
):
    cfg = vlm_run(
        base_cfg, tiny_vlm["qwen2_vl"], "qwen2_vl", mllm_demo, max_steps=2,
        freeze_language_model=True, freeze_vision_tower=False,
    )  # fmt: skip
    train(None, cfg)
    targets = json.loads((Path(cfg["output_dir"]) / "adapter_config.json").read_text())["target_modules"]
    assert targets and all("visual.blocks" in t for t in targets)  # not the patch embedding, not the LM


def test_export_merges_the_adapter_and_saves_the_processor(tiny_vlm, mllm_demo, base_cfg, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from lmstack.infer.export import export

    cfg = vlm_run(base_cfg, tiny_vlm["qwen2_vl"], "qwen2_vl", mllm_demo, max_steps=2)
    train(None, cfg)
    out = export(
        None, {**cfg, "adapter_name_or_path": cfg["output_dir"], "export_dir": str(tmp_path / "merged")}
    )
    model = AutoModelForImageTextToText.from_pretrained(out)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert type(AutoImageProcessor.from_pretrained(out)).__name__ == "Qwen2VLImageProcessorPil"
    before = load_file(tiny_vlm["qwen2_vl"] / "model.safetensors")
    after = {k: v for f in sorted(Path(out).glob("model*.safetensors")) for k, v in load_file(f).items()}
    assert _changed(before, after, "layers.1.self_attn.q_proj")  # saved as the checkpoint names it
    assert not _changed(before, after, "visual.blocks")


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "llava"])
def test_chat_image_command_and_openai_image_parts_build_the_training_prompt(
    family, tiny_vlm, mllm_demo, base_cfg
):
    import base64

    from lmstack.config.load import build_config
    from lmstack.data.pipeline import build_datasets
    from lmstack.infer.engine import ChatEngine
    from lmstack.infer.vision import VisionChatSession, openai_messages, session_for

    cfg = build_config({**vlm_run(base_cfg, tiny_vlm[family], family, mllm_demo), "max_new_tokens": 3})
    engine = ChatEngine.from_config(cfg)
    session = session_for(engine)
    assert isinstance(session, VisionChatSession)
    image = mllm_demo / "mllm_demo_data" / "0.png"
    (note,) = session.send(f"/image {image}")
    assert note.startswith("[image 1 attached to your next message")
    (reply,) = session.send("What colour is this picture?")
    assert isinstance(reply, str) and session.images and not session.pending
    assert session.messages[0]["content"] == "<image>What colour is this picture?"  # LF: before the text

    # the chat prompt is the training prompt of the same record (mllm_demo record 0, its answer dropped)
    sample = build_datasets(cfg, engine.tokenizer, engine.template).train[0]
    prompt_len = sample["labels"].index(next(t for t in sample["labels"] if t != -100))
    ids, extra = session.vision.prompt(
        [{"role": "user", "content": "<image>What colour is this picture?"}], session.images
    )
    assert ids == sample["input_ids"][:prompt_len]
    assert "pixel_values" in extra

    url = "data:image/png;base64," + base64.b64encode(image.read_bytes()).decode()
    parts = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What colour is this picture?"},
    ]
    messages, images = openai_messages([{"role": "user", "content": parts}])
    assert messages == [{"role": "user", "content": "<image>What colour is this picture?"}]
    assert session.vision.prompt(messages, images)[0] == ids
    result = session.vision.generate(messages, images)
    assert result.prompt_tokens == len(ids) and result.completion_tokens <= 3


def test_an_image_changed_after_tokenizing_is_named_before_the_model_sees_it(tiny_vlm, mllm_demo, base_cfg):
    from PIL import Image

    from lmstack.config.errors import DataError
    from lmstack.config.load import build_config
    from lmstack.data.mm import media_spec
    from lmstack.data.mm_collate import MediaCollator
    from lmstack.data.pipeline import build_datasets
    from lmstack.models.load import load_tokenizer
    from lmstack.models.vision import load_image_processor
    from lmstack.templates import get_template

    cfg = build_config(vlm_run(base_cfg, tiny_vlm["qwen2_vl"], "qwen2_vl", mllm_demo))
    tok = load_tokenizer(cfg)
    data = build_datasets(cfg, tok, get_template("qwen2_vl", tok)).train
    spec = media_spec(cfg)
    collate = MediaCollator(
        tok.pad_token_id, spec, load_image_processor(cfg), tok.convert_tokens_to_ids("<|image_pad|>")
    )
    batch = collate([data[0], data[1]])
    assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(-1).sum())
    Image.new("RGB", (300, 200), (0, 0, 0)).save(mllm_demo / "mllm_demo_data" / "1.png")  # 12 tokens, not 6
    with pytest.raises(
        DataError, match=r"1.png: the tokenized sample holds 6 image tokens, the processor makes 12"
    ):
        collate([data[0], data[1]])


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_the_planned_chunked_cross_entropy_equals_the_vision_models_own_loss(
    family, tiny_vlm, mllm_demo, base_cfg
):
    """The run plan's loss_kernel (chunked linear CE, no [tokens x vocab] logits) replaces the forward
    of vision models too: the same loss as the model's own, the images going through the decoder."""
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

    cfg = build_config(vlm_run(base_cfg, tiny_vlm[family], family, mllm_demo))
    tok = load_tokenizer(cfg)
    data = build_datasets(cfg, tok, get_template(cfg.data.template, tok)).train
    spec = media_spec(cfg)
    image_id = tok.convert_tokens_to_ids(spec.tokens[1])
    batch = MediaCollator(tok.pad_token_id, spec, load_image_processor(cfg), image_id)([data[0], data[1]])
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm[family]).train()
    own = model(**batch).loss
    assert apply_fused_ce(model)
    chunked = model(**batch).loss
    torch.testing.assert_close(chunked, own, rtol=1e-5, atol=1e-5)
    other = dict(batch, pixel_values=torch.zeros_like(batch["pixel_values"]))
    assert not torch.allclose(model(**other).loss, chunked)  # the pixels are read


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "llava"])
def test_the_planner_reads_a_vision_model_with_its_vision_tower(family, tiny_vlm):
    """The planner's model spec (gradient_checkpointing: auto, lmstack plan) built AutoModelForCausalLM,
    which has no class for these configs; now the whole model, vision tower included, is counted."""
    from transformers import AutoModelForImageTextToText

    from lmstack.memory.model_spec import ModelSpec

    spec = ModelSpec.from_pretrained_dir(tiny_vlm[family])
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm[family])
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    assert spec.num_layers == 2 and spec.hidden_size == 128  # the language model's dims


@pytest.fixture
def rlhf_v_demo(tmp_path) -> Path:
    """Image preference pairs in LF's sharegpt ranking layout (its rlhf_v demo): conversations +
    chosen / rejected messages + images."""
    from PIL import Image

    folder = tmp_path / "pref"
    (folder / "imgs").mkdir(parents=True)
    records = []
    for i, (name, rgb) in enumerate(COLOURS.items()):
        Image.new("RGB", (56 + 8 * i, 56), rgb).save(folder / "imgs" / f"{i}.png")
        wrong = list(COLOURS)[(i + 1) % len(COLOURS)]
        records.append(
            {
                "conversations": [{"from": "human", "value": "<image>Which colour is it?"}],
                "chosen": {"from": "gpt", "value": f"It is {name}."},
                "rejected": {"from": "gpt", "value": f"It is {wrong}."},
                "images": [f"imgs/{i}.png"],
            }
        )
    (folder / "pref.json").write_text(json.dumps(records))
    entry = {"file_name": "pref.json", "formatting": "sharegpt", "ranking": True}
    entry["columns"] = {
        "messages": "conversations",
        "chosen": "chosen",
        "rejected": "rejected",
        "images": "images",
    }
    (folder / "dataset_info.json").write_text(json.dumps({"rlhf_v_demo": entry}))
    return folder


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_dpo_on_image_preference_pairs_learns_the_preference(family, tiny_vlm, rlhf_v_demo, base_cfg):
    cfg = vlm_run(
        base_cfg, tiny_vlm[family], family, rlhf_v_demo, stage="dpo", dataset="rlhf_v_demo",
        max_steps=12, learning_rate=1e-2, pref_beta=0.1,
    )  # fmt: skip
    train(None, cfg)
    out = Path(cfg["output_dir"])
    logs = [json.loads(ln) for ln in (out / "trainer_log.jsonl").read_text().splitlines()]
    seen = [r["loss"] for r in logs if "loss" in r]
    assert seen[0] == pytest.approx(0.6931, abs=1e-3)  # policy = reference at step 1: log 2
    assert seen[-1] < 0.5 * seen[0], seen
    targets = json.loads((out / "adapter_config.json").read_text())["target_modules"]
    assert all("language_model" in t for t in targets)
    assert (out / "preprocessor_config.json").is_file()


def test_the_preference_collator_gives_each_row_of_a_pair_its_images(tiny_vlm, rlhf_v_demo, base_cfg):
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from lmstack.config.load import build_config
    from lmstack.data.mm import media_spec
    from lmstack.data.mm_collate import PreferenceMediaCollator
    from lmstack.data.pipeline import build_datasets
    from lmstack.models.load import load_tokenizer
    from lmstack.models.vision import load_image_processor
    from lmstack.templates import get_template
    from lmstack.train import rlhf

    cfg = build_config(
        vlm_run(base_cfg, tiny_vlm["qwen2_vl"], "qwen2_vl", rlhf_v_demo, stage="dpo", dataset="rlhf_v_demo")
    )
    tok = load_tokenizer(cfg)
    rows = build_datasets(cfg, tok, get_template("qwen2_vl", tok)).train
    features = [{**rlhf.pairwise_columns(rows[i]), "image_paths": rows[i]["images"]} for i in (0, 1)]
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    inner = DataCollatorForPreference(pad_token_id=tok.pad_token_id)
    batch = PreferenceMediaCollator(inner, media_spec(cfg), load_image_processor(cfg), image_id)(features)
    assert (
        batch["input_ids"].shape[0] == 4 and batch["image_grid_thw"].shape[0] == 4
    )  # chosen 0, 1; rejected 0, 1
    assert batch["image_grid_thw"][:2].tolist() == batch["image_grid_thw"][2:].tolist()
    per_row = (batch["input_ids"] == image_id).sum(-1).tolist()
    assert per_row[:2] == per_row[2:] and all(n > 0 for n in per_row)
    assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(-1).sum())
