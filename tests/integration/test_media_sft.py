"""LF's video and audio demo layouts (mllm_video_demo: mp4 + avi; mllm_audio_demo: wav + flac + mp3, all
made here) train through `lmstack train` (the real Trainer) on the tiny Qwen2-VL / Qwen2.5-VL / Qwen3-VL
(dense and MoE: timestamped frame groups) and Qwen2-Audio: the loss falls, the adapter holds the language model only, and it reloads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmstack.train.run import train
from media_files import demo_dir

MODEL_CLASS = {
    "qwen2_vl": "AutoModelForImageTextToText",
    "qwen2_5_vl": "AutoModelForImageTextToText",
    "qwen3_vl": "AutoModelForImageTextToText",
    "qwen3_vl_moe": "AutoModelForImageTextToText",
    "qwen2_audio": "Qwen2AudioForConditionalGeneration",
}

TEMPLATES = {"qwen2_audio": "qwen2_audio", "qwen3_vl": "qwen3_vl_nothink", "qwen3_vl_moe": "qwen3_vl_nothink"}


@pytest.fixture(scope="module")
def tiny_media(tmp_path_factory):
    from lmstack.tiny import build_tiny_vision_model

    root = tmp_path_factory.mktemp("tiny_media")
    data = Path(__file__).resolve().parents[2] / "data"
    return {f: build_tiny_vision_model(root / f, f, data_dir=data) for f in MODEL_CLASS}


def losses(out: Path) -> list[float]:
    lines = (out / "trainer_log.jsonl").read_text().splitlines()
    return [json.loads(ln)["loss"] for ln in lines if "loss" in json.loads(ln)]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen2_audio"])
def test_lora_on_video_and_audio_demos_loss_falls_and_adapter_reloads(family, tiny_media, base_cfg, tmp_path):
    import transformers
    from peft import PeftModel

    kind = "audios" if family == "qwen2_audio" else "videos"
    data = demo_dir(tmp_path, kind)
    cfg = {
        **base_cfg,
        "model_name_or_path": str(tiny_media[family]),
        "template": TEMPLATES.get(family, "qwen2_vl"),
        "dataset": f"mllm_{kind[:-1]}_demo",
        "dataset_dir": str(data),
        "cutoff_len": 512,
        "per_device_train_batch_size": 3,
        "max_steps": 10,
        "learning_rate": 2e-2,
        "video_maxlen": 4,
    }
    train(None, cfg)
    out = Path(cfg["output_dir"])
    seen = losses(out)
    assert seen[-1] < 0.5 * seen[0], seen
    targets = json.loads((out / "adapter_config.json").read_text())["target_modules"]
    assert targets and all("language_model" in t for t in targets)  # LF's default: towers frozen
    assert (out / "preprocessor_config.json").is_file()  # the image processor / feature extractor travels
    if kind == "videos":
        assert (out / "video_preprocessor_config.json").is_file()
    base = getattr(transformers, MODEL_CLASS[family]).from_pretrained(tiny_media[family])
    model = PeftModel.from_pretrained(base, out)
    assert sum("lora_A" in n for n, _ in model.named_parameters()) == len(targets)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "qwen2_audio"])
def test_chat_video_and_audio_commands_build_the_training_prompt(family, tiny_media, base_cfg, tmp_path):
    from lmstack.config.load import build_config
    from lmstack.data.pipeline import build_datasets
    from lmstack.infer.engine import ChatEngine
    from lmstack.infer.vision import VisionChatSession, session_for

    kind = "audios" if family == "qwen2_audio" else "videos"
    data = demo_dir(tmp_path, kind)
    cfg = build_config(
        {
            **base_cfg,
            "model_name_or_path": str(tiny_media[family]),
            "template": TEMPLATES.get(family, "qwen2_vl"),
            "dataset": f"mllm_{kind[:-1]}_demo",
            "dataset_dir": str(data),
            "cutoff_len": 512,
            "max_new_tokens": 3,
        }
    )
    engine = ChatEngine.from_config(cfg)
    session = session_for(engine)
    assert isinstance(session, VisionChatSession)
    record = json.loads((data / f"mllm_{kind[:-1]}_demo.json").read_text())[0]
    media = data / record[kind][0]
    question = record["messages"][0]["content"].split(">", 1)[1]
    wrong = "/audio" if kind == "videos" else "/video"
    (refused,) = session.send(f"{wrong} {media}")
    assert refused.startswith(f"[{family} models read no ")
    (note,) = session.send(f"/{kind[:-1]} {media}")
    assert note.startswith(f"[{kind[:-1]} 1 attached to your next message")
    (reply,) = session.send(question)
    assert isinstance(reply, str) and session.files[kind] == [str(media.resolve())]
    assert session.messages[0]["content"] == record["messages"][0]["content"]  # LF: before the text

    # the chat prompt is the training prompt of the same record (its answer dropped)
    sample = build_datasets(cfg, engine.tokenizer, engine.template).train[0]
    prompt_len = sample["labels"].index(next(t for t in sample["labels"] if t != -100))
    files = {kind: [str(media)]}
    ids, extra = session.vision.prompt([record["messages"][0]], [], **files)
    assert ids == sample["input_ids"][:prompt_len]
    assert ("pixel_values_videos" if kind == "videos" else "input_features") in extra
    result = session.vision.generate([record["messages"][0]], [], **files)
    assert result.prompt_tokens == len(ids) and result.completion_tokens <= 3
