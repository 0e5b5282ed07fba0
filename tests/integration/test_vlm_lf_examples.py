"""LLaMA-Factory's own vision example YAMLs (examples/train_lora/qwen3vl_lora_sft.yaml,
train_full/qwen3vl_full_sft.yaml, train_lora/qwen3vl_lora_dpo.yaml, extras/oft/qwen2_5vl_oft_sft.yaml,
as LF ships them) pass `lmstack check` with only model_name_or_path and dataset_dir swapped: a tiny
model of the same family, and a dataset_dir laid out as LF's data/ (mllm_demo with its two images per
record, identity, alpaca_en_demo, rlhf_v; mllm_video_demo, the video dataset their comments name).
image_max_pixels resizes the images, video_max_pixels the Qwen3-VL video frames, before the processor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from media_files import write_video

REPO = Path(__file__).resolve().parents[2]

# LF's files, verbatim (hiyouga/LLaMA-Factory, examples/)
QWEN3VL_LORA_SFT = """\
### model
model_name_or_path: Qwen/Qwen3-VL-4B-Instruct
image_max_pixels: 262144
video_max_pixels: 16384
trust_remote_code: true

### method
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all

### dataset
dataset: mllm_demo,identity,alpaca_en_demo  # video: mllm_video_demo
template: qwen3_vl_nothink
cutoff_len: 2048
max_samples: 1000
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: saves/qwen3-vl-4b/lora/sft
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none  # choices: [none, wandb, tensorboard, swanlab, mlflow]

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
resume_from_checkpoint: null

### eval
# val_size: 0.1
# per_device_eval_batch_size: 1
# eval_strategy: steps
# eval_steps: 500
"""

QWEN3VL_FULL_SFT = """\
### model
model_name_or_path: Qwen/Qwen3-VL-4B-Instruct
image_max_pixels: 262144
video_max_pixels: 16384
trust_remote_code: true

### method
stage: sft
do_train: true
finetuning_type: full
freeze_vision_tower: true
freeze_multi_modal_projector: true
freeze_language_model: false
deepspeed: examples/deepspeed/ds_z3_config.json

### dataset
dataset: mllm_demo,identity,alpaca_en_demo
template: qwen3_vl_nothink
cutoff_len: 2048
max_samples: 1000
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: saves/qwen3-vl-4b/full/sft
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none  # choices: [none, wandb, tensorboard, swanlab, mlflow]

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 2
learning_rate: 1.0e-5
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
resume_from_checkpoint: null

### eval
# val_size: 0.1
# per_device_eval_batch_size: 1
# eval_strategy: steps
# eval_steps: 500
"""

QWEN3VL_LORA_DPO = """\
### model
model_name_or_path: Qwen/Qwen3-VL-4B-Instruct
image_max_pixels: 262144
video_max_pixels: 16384
trust_remote_code: true

### method
stage: dpo
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all
pref_beta: 0.1
pref_loss: sigmoid  # choices: [sigmoid (dpo), orpo, simpo]

### dataset
dataset: rlhf_v
template: qwen3_vl_nothink
cutoff_len: 2048
max_samples: 1000
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: saves/qwen3-vl-4b/lora/dpo
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none  # choices: [none, wandb, tensorboard, swanlab, mlflow]

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 5.0e-6
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
resume_from_checkpoint: null

### eval
# val_size: 0.1
# per_device_eval_batch_size: 1
# eval_strategy: steps
# eval_steps: 500
"""

QWEN2_5VL_OFT_SFT = """\
### model
model_name_or_path: Qwen/Qwen2.5-VL-7B-Instruct
image_max_pixels: 262144
video_max_pixels: 16384
trust_remote_code: true

### method
stage: sft
do_train: true
finetuning_type: oft
oft_block_size: 32
oft_target: all

### dataset
dataset: mllm_demo,identity,alpaca_en_demo  # video: mllm_video_demo
template: qwen2_vl
cutoff_len: 2048
max_samples: 1000
overwrite_cache: true
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: saves/qwen2_5vl-7b/oft/sft
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none  # choices: [none, wandb, tensorboard, swanlab, mlflow]

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
resume_from_checkpoint: null

### eval
# val_size: 0.1
# per_device_eval_batch_size: 1
# eval_strategy: steps
# eval_steps: 500
"""

# (file, YAML, tiny family, datasets checked)
EXAMPLES = [
    ("qwen3vl_lora_sft.yaml", QWEN3VL_LORA_SFT, "qwen3_vl", ["mllm_demo", "identity", "alpaca_en_demo"]),
    ("qwen3vl_full_sft.yaml", QWEN3VL_FULL_SFT, "qwen3_vl", ["mllm_demo", "identity", "alpaca_en_demo"]),
    ("qwen3vl_lora_dpo.yaml", QWEN3VL_LORA_DPO, "qwen3_vl", ["rlhf_v"]),
    ("qwen2_5vl_oft_sft.yaml", QWEN2_5VL_OFT_SFT, "qwen2_5_vl", ["mllm_demo", "identity", "alpaca_en_demo"]),
]
PHOTO = (640, 480)  # the demo photos' stand-ins: larger than image_max_pixels 262144 (512 x 512)
RESIZED = "591x443"  # LF's resize: sqrt(262144 / 307200) = 0.9238 of each side, truncated
# the processors' own resize of 591x443: the tiny Qwen3-VL (32-pixel units, at most 128 x 128
# pixels) and Qwen2.5-VL (28-pixel units, at most 112 x 112)
MODEL_INPUT = {"qwen3_vl": "128x96", "qwen2_5_vl": "112x84"}
VIDEO = (160, 120)  # the demo videos' stand-ins: 9 frames at 4 fps, larger than video_max_pixels 16384


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from lmstack.tiny import build_tiny_vision_model

    root = tmp_path_factory.mktemp("tiny_lf_vlm")
    return {f: build_tiny_vision_model(root / f, f, data_dir=REPO / "data") for f in MODEL_INPUT}


@pytest.fixture
def lf_data(tmp_path) -> Path:
    return write_lf_data(tmp_path / "data")


def write_lf_data(folder: Path) -> Path:
    """LF's data/ layout: its dataset_info.json entries for these four datasets (rlhf_v, a hub dataset
    in LF, as a local file of the same columns), mllm_demo.json as LF ships it (two images per
    record: one in the first user turn, one in the second), lmstack's identity / alpaca_en_demo."""
    from PIL import Image

    (folder / "mllm_demo_data").mkdir(parents=True)
    for i, rgb in enumerate([(200, 40, 40), (40, 160, 60), (40, 60, 200)], start=1):
        Image.new("RGB", PHOTO, rgb).save(folder / "mllm_demo_data" / f"{i}.jpg")
    turns = [
        ("Who are they?", "They're Kane and Gretzka from Bayern Munich.", "What are they doing?",
         "They are celebrating on the soccer field."),
        ("Who is he?", "He's Thomas Muller from Bayern Munich.", "Why is he on the ground?",
         "Because he's sliding on his knees to celebrate."),
        ("Please describe this image", "Chinese astronaut Gui Haichao is giving a speech.",
         "What has he accomplished?", "He was appointed to be a payload specialist on Shenzhou 16."),
    ]  # fmt: skip
    records = [
        {
            "messages": [
                {"content": f"<image>{q1}", "role": "user"},
                {"content": a1, "role": "assistant"},
                {"content": f"{q2}<image>", "role": "user"},
                {"content": a2, "role": "assistant"},
            ],
            "images": [f"mllm_demo_data/{i}.jpg"] * 2,
        }
        for i, (q1, a1, q2, a2) in enumerate(turns, start=1)
    ]
    (folder / "mllm_demo.json").write_text(json.dumps(records))
    pairs = [
        {
            "conversations": [{"from": "human", "value": "<image>What colour is the picture?"}],
            "chosen": {"from": "gpt", "value": answer},
            "rejected": {"from": "gpt", "value": "A dog on a beach."},
            "images": [f"mllm_demo_data/{i}.jpg"],
        }
        for i, answer in enumerate(["Red.", "Green.", "Blue."], start=1)
    ]
    (folder / "rlhf_v.json").write_text(json.dumps(pairs))
    questions = ["Why is this video funny?", "What is she doing?", "What is the man doing?"]
    for i, name in enumerate(["1.mp4", "2.avi", "3.mp4"]):
        write_video(folder / "mllm_demo_data" / name, frames=9, size=VIDEO, fps=4, seed=i)
    videos = [
        {
            "messages": [
                {"content": f"<video>{q}", "role": "user"},
                {"content": "A short clip.", "role": "assistant"},
            ],
            "videos": [f"mllm_demo_data/{name}"],
        }
        for q, name in zip(questions, ["1.mp4", "2.avi", "3.mp4"])
    ]
    (folder / "mllm_video_demo.json").write_text(json.dumps(videos))
    for name in ("identity.json", "alpaca_en_demo.json"):
        shutil.copyfile(REPO / "data" / name, folder / name)
    tags = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
    info = {
        "identity": {"file_name": "identity.json"},
        "alpaca_en_demo": {"file_name": "alpaca_en_demo.json"},
        "rlhf_v": {
            "file_name": "rlhf_v.json",
            "ranking": True,
            "formatting": "sharegpt",
            "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected", "images": "images"},
        },
        "mllm_demo": {
            "file_name": "mllm_demo.json",
            "formatting": "sharegpt",
            "columns": {"messages": "messages", "images": "images"},
            "tags": tags,
        },
        "mllm_video_demo": {
            "file_name": "mllm_video_demo.json",
            "formatting": "sharegpt",
            "columns": {"messages": "messages", "videos": "videos"},
            "tags": tags,
        },
    }  # fmt: skip
    (folder / "dataset_info.json").write_text(json.dumps(info, indent=2))
    return folder


@pytest.mark.parametrize("name,text,family,datasets", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_lfs_vision_example_yaml_passes_check_with_model_and_dataset_dir_swapped(
    name, text, family, datasets, tiny_models, lf_data, tmp_path, monkeypatch
):
    from lmstack.cli.check import run_check

    # run where LF's examples run: a folder holding examples/deepspeed/ (the full-SFT example's ZeRO-3 file)
    monkeypatch.chdir(tmp_path)
    shutil.copytree(REPO / "examples" / "deepspeed", tmp_path / "examples" / "deepspeed")
    (tmp_path / name).write_text(text)
    swapped = {"model_name_or_path": str(tiny_models[family]), "dataset_dir": str(lf_data)}
    report, path = run_check(str(tmp_path / name), swapped)

    assert (tmp_path / path).is_file() and path.parts[0] == "saves"  # output_dir, relative as in LF
    assert [d["name"] for d in report["datasets"]] == datasets
    assert report["totals"]["problems"] == 0 and report["totals"]["dropped"] == {}
    assert report["totals"]["kept"] == report["totals"]["records"] > 0
    by_name = {d["name"]: d for d in report["datasets"]}
    media = by_name[datasets[0]]["media"]
    images = 6 if datasets[0] == "mllm_demo" else 3
    assert media["images"] == images and media["samples_with_images"] == 3
    assert media["resized"] == [RESIZED, RESIZED]  # image_max_pixels: 262144 applied before the processor
    assert media["model_input"] == [MODEL_INPUT[family]] * 2
    assert media["image_tokens"] == images * 12  # 128x96 / 32^2, 112x84 / 28^2: 12 tokens each
    for text_only in datasets[1:]:
        assert by_name[text_only]["media"]["images"] == 0
    decisions = report["run_plan"]["decisions"]
    assert decisions["stage"] == ("dpo" if "dpo" in name else "sft")
    if "full" in name:
        assert decisions["zero_stage"] == 3
        assert decisions["deepspeed"] == "examples/deepspeed/ds_z3_config.json"
    example = "".join(part["text"] for part in report["example"])
    assert report["example_dataset"] == datasets[0]
    assert example.count("<|vision_start|>" + "<|image_pad|>" * 12 + "<|vision_end|>") == images // 3


def test_lfs_oft_example_trains_the_language_model_of_the_tiny_qwen2_5_vl(
    tiny_models, lf_data, tmp_path, monkeypatch
):
    """qwen2_5vl_oft_sft.yaml runs, not only checks: OFT (block size 32) on every linear layer of the
    language model, the vision tower and projector left out (LF's defaults freeze them), on LF's mixed
    image + text datasets; the adapter reloads onto the base model."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from lmstack.train.run import train

    monkeypatch.chdir(tmp_path)
    (tmp_path / "oft.yaml").write_text(QWEN2_5VL_OFT_SFT)
    base = tiny_models["qwen2_5_vl"]
    overrides = [f"model_name_or_path={base}", f"dataset_dir={lf_data}", "max_steps=3", "logging_steps=1",
                 "max_samples=8", "bf16=false", "save_steps=100"]  # fmt: skip
    train(str(tmp_path / "oft.yaml"), overrides)
    out = tmp_path / "saves" / "qwen2_5vl-7b" / "oft" / "sft"
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "OFT" and config["oft_block_size"] == 32
    targets = config["target_modules"]
    assert targets and all("language_model" in t for t in targets)
    assert not any("visual" in t for t in targets)
    logs = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert sum("loss" in r for r in logs) == 3
    model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base), out)
    assert any("oft_R" in n for n, _ in model.named_parameters())


@pytest.mark.parametrize(
    "name,text", [(e[0], e[1]) for e in EXAMPLES if e[0].startswith("qwen3vl_") and "sft" in e[0]]
)
def test_lfs_qwen3vl_sft_examples_pass_check_on_their_video_dataset(
    name, text, tiny_models, lf_data, tmp_path, monkeypatch
):
    """The dataset their own comment names (`# video: mllm_video_demo`): video_max_pixels 16384 shrinks
    the 160x120 frames to 147x110 (sqrt(16384 / 19200) of each side, truncated); LF samples floor(2.25 s
    x video_fps 2) = 4 frames, the tiny processor keeps the 4 and resizes the clip to 160x96 (32-pixel
    units, 4 x 96 x 160 within its bounds): 10 x 6 patches, 15 tokens per frame group, 2 groups at 0.25 s
    and 1.25 s: 30 video tokens a video."""
    from lmstack.cli.check import run_check

    monkeypatch.chdir(tmp_path)
    shutil.copytree(REPO / "examples" / "deepspeed", tmp_path / "examples" / "deepspeed")
    (tmp_path / name).write_text(text)
    swapped = {"model_name_or_path": str(tiny_models["qwen3_vl"]), "dataset_dir": str(lf_data),
               "dataset": "mllm_video_demo"}  # fmt: skip
    report, _ = run_check(str(tmp_path / name), swapped)
    assert report["totals"]["problems"] == 0 and report["totals"]["dropped"] == {}
    assert report["totals"]["kept"] == report["totals"]["records"] == 3
    videos = report["datasets"][0]["videos"]
    assert videos == {"files": 3, "samples": 3, "tokens": 90, "tokens_per_sample": {"min": 30, "max": 30}}
    example = "".join(part["text"] for part in report["example"])
    group = "<|vision_start|>" + "<|video_pad|>" * 15 + "<|vision_end|>"
    assert f"<0.2 seconds>{group}<1.2 seconds>{group}Why is this video funny?" in example
