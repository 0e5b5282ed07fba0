"""LLaMA-Factory-style YAMLs (the shape of LF's examples/: section comments, LF's fields and values) run
on the tiny model as written — only the model path, output_dir and dataset_dir point at the test's files,
and max_steps keeps each run short — or are refused with words naming the LF feature lmstack lacks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lmstack.config.errors import ConfigError, LmstackError
from lmstack.train.run import train

HERE = Path(__file__).resolve().parents[1] / "fixtures" / "lf_yamls"
DATA = Path(__file__).resolve().parents[2] / "data"
TRAIN_YAMLS = sorted(p.name for p in HERE.glob("*.yaml") if not p.stem.endswith(("_merge", "_infer")))


def materialise(name: str, tmp_path: Path, tiny_model: Path, **subs: str) -> Path:
    text = (HERE / name).read_text().replace("TINY_MODEL", str(tiny_model))
    for key, value in subs.items():
        text = text.replace(key, value)
    path = tmp_path / name
    path.write_text(text)
    return path


def run_lf(name: str, tmp_path: Path, tiny_model: Path) -> Path:
    out = tmp_path / "out"
    path = materialise(name, tmp_path, tiny_model)
    train(str(path), [f"output_dir={out}", f"dataset_dir={DATA}", "max_steps=2", "save_steps=2"])
    return out


@pytest.mark.parametrize("name", TRAIN_YAMLS)
def test_lf_training_yaml_runs_as_written(name, tmp_path, tiny_model):
    out = run_lf(name, tmp_path, tiny_model)
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    saved = yaml.safe_load((out / "lmstack_config.yaml").read_text())
    written = yaml.safe_load((HERE / name).read_text())
    for key, value in written.items():  # every field the LF user wrote is what ran (paths aside)
        if (
            key in ("model_name_or_path", "output_dir", "save_steps", "resume_from_checkpoint", "report_to")
            or value is None
        ):
            continue
        assert saved[key] == value, (key, saved[key], value)
    assert (out / "run_manifest.json").is_file()


def test_lf_merge_and_inference_yamls_use_the_trained_adapter(tmp_path, tiny_model):
    from lmstack.infer.engine import ChatEngine, load_infer_config
    from lmstack.infer.export import export

    adapter = run_lf("qwen_lora_sft.yaml", tmp_path, tiny_model)
    merge = materialise("qwen_lora_sft_merge.yaml", tmp_path, tiny_model, ADAPTER_DIR=str(adapter),
                        EXPORT_DIR=str(tmp_path / "merged"))  # fmt: skip
    exported = Path(export(str(merge), None))
    assert (exported / "config.json").is_file() and any(exported.glob("*.safetensors"))
    infer = materialise("qwen_lora_sft_infer.yaml", tmp_path, tiny_model, ADAPTER_DIR=str(adapter))
    engine = ChatEngine.from_config(load_infer_config(str(infer), ["do_sample=false", "max_new_tokens=4"]))
    reply = "".join(engine.stream([{"role": "user", "content": "Hi"}]))
    assert isinstance(reply, str)


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"use_unsloth": True}, "use_unsloth: true needs a CUDA GPU"),
        ({"use_kt": True}, "not available in lmstack"),
        ({"infer_backend": "vllm"}, "infer_backend: vllm serves chat/api only; train and eval need"),
        ({"use_audio_in_video": True}, "not available in lmstack"),
        ({"image_do_pan_and_scan": True}, "image_do_pan_and_scan: true is Gemma 3.s pan-and-scan crops"),
        ({"tensor_model_parallel_size": 2}, "not available in lmstack"),
    ],
)
def test_lf_features_lmstack_lacks_are_refused_by_name(fields, words, tmp_path, tiny_model):
    flat = yaml.safe_load(materialise("qwen_lora_sft.yaml", tmp_path, tiny_model).read_text())
    flat.update(fields, output_dir=str(tmp_path / "out"), dataset_dir=str(DATA), max_steps=2)
    with pytest.raises(LmstackError, match=words):
        train(None, flat)


def test_lf_v1_yaml_is_recognised(tmp_path, tiny_model):
    path = tmp_path / "v1.yaml"
    path.write_text(
        yaml.safe_dump({"model": {"model_name_or_path": str(tiny_model)}, "peft_config": {"name": "lora"}})
    )
    with pytest.raises(ConfigError, match="v0"):
        train(str(path), [])
