"""End-to-end SFT on the tiny model (CPU, offline): outputs, learning, reload, full/freeze."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmstack.config.errors import ConfigError, DataError, LmstackError
from lmstack.train.run import train

REPO = Path(__file__).resolve().parents[2]


def losses(out: Path) -> list[float]:
    return [
        json.loads(line)["loss"]
        for line in (out / "trainer_log.jsonl").read_text().splitlines()
        if "loss" in json.loads(line)
    ]


def test_lora_sft_learns_and_writes_lf_outputs(base_cfg, tiny_model):
    cfg = {
        **base_cfg,
        "max_steps": 24,
        "lora_rank": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "save_steps": 10,
        "plot_loss": True,
        "val_size": 0.1,
        "do_eval": True,
    }
    train(None, cfg)
    out = Path(cfg["output_dir"])
    for name in (
        "adapter_model.safetensors",
        "adapter_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "trainer_state.json",
        "trainer_log.jsonl",
        "train_results.json",
        "all_results.json",
        "eval_results.json",
        "training_loss.png",
        "lmstack_config.yaml",
    ):
        assert (out / name).is_file(), name
    assert {p.name for p in out.glob("checkpoint-*")} == {"checkpoint-10", "checkpoint-20", "checkpoint-24"}
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["r"] == 8 and adapter["lora_alpha"] == 16 and adapter["lora_dropout"] == 0.0
    assert adapter["peft_type"] == "LORA" and adapter["task_type"] == "CAUSAL_LM"
    assert sorted(adapter["target_modules"]) == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    assert adapter["base_model_name_or_path"] == str(tiny_model)
    assert (out / "training_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    log = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines()]
    first = log[0]
    for key in (
        "current_steps",
        "total_steps",
        "loss",
        "lr",
        "epoch",
        "percentage",
        "elapsed_time",
        "remaining_time",
    ):
        assert key in first, key
    assert [r["current_steps"] for r in log if "loss" in r] == list(range(1, 25))
    curve = losses(out)
    assert sum(curve[-4:]) / 4 < sum(curve[:4]) / 4 - 0.3, curve
    results = json.loads((out / "all_results.json").read_text())
    assert "train_loss" in results and "eval_loss" in results
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 24
    # the saved tokenizer chats in the training template (qwen), not the base tokenizer's own
    from transformers import AutoTokenizer

    from lmstack.templates import get_template

    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    saved = AutoTokenizer.from_pretrained(out).apply_chat_template(msgs, tokenize=False)
    assert saved == get_template("qwen").render(msgs) and "You are Qwen" in saved


def test_reloaded_adapter_gives_same_logits(base_cfg, tiny_model):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = {**base_cfg, "max_steps": 3}
    train(None, cfg)
    out = Path(cfg["output_dir"])
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, out).eval()
    ids = torch.tensor([[5, 17, 99, 300, 2]])
    # rebuild the in-memory result: the adapter weights saved at the end are the trained ones
    weights = load_file(out / "adapter_model.safetensors")
    assert all(t.numel() > 0 for t in weights.values())
    assert any(t.abs().sum() > 0 for k, t in weights.items() if "lora_B" in k), (
        "lora_B still zero: not trained"
    )
    manual = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        for name, module in manual.named_modules():
            key_a = f"base_model.model.{name}.lora_A.weight"
            if key_a in weights:
                delta = weights[f"base_model.model.{name}.lora_B.weight"] @ weights[key_a] * (16 / 8)
                module.weight += delta
        expected = manual(ids).logits
        got = model(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["full", "freeze"])
def test_full_and_freeze_change_exactly_the_right_parameters(base_cfg, tiny_model, kind):
    from transformers import AutoModelForCausalLM

    cfg = {
        **base_cfg,
        "finetuning_type": kind,
        "max_steps": 3,
        "learning_rate": 1e-3,
        "freeze_trainable_layers": 1,
    }
    train(None, cfg)
    before = load_file(Path(tiny_model) / "model.safetensors")
    after = AutoModelForCausalLM.from_pretrained(cfg["output_dir"], dtype=torch.float32).state_dict()
    changed = {k for k, v in before.items() if not torch.equal(v, after[k])}
    if kind == "full":
        assert changed == set(before), set(before) - changed
    else:  # freeze: only the last of 2 layers is trained; everything else bit-identical
        assert changed and all(".layers.1." in k for k in changed), changed
        assert all(torch.equal(before[k], after[k]) for k in before if ".layers.1." not in k)


def test_freeze_trainable_layers_past_the_layer_count_trains_every_layer_like_lf(base_cfg, tiny_model):
    """LF clamps freeze_trainable_layers to the model's layers (range(max(0, N - k), N)): 5 on the 2-layer tiny
    model trains both layers and nothing outside them."""
    cfg = {**base_cfg, "finetuning_type": "freeze", "max_steps": 2, "learning_rate": 1e-3,
           "freeze_trainable_layers": 5}  # fmt: skip
    train(None, cfg)
    before = load_file(Path(tiny_model) / "model.safetensors")
    after = load_file(Path(cfg["output_dir"]) / "model.safetensors")
    changed = {k for k, v in before.items() if not torch.equal(v, after[k])}
    assert any(".layers.0." in k for k in changed) and any(".layers.1." in k for k in changed)
    assert all(".layers." in k for k in changed), changed


def test_freeze_trainable_layers_zero_without_extra_modules_fails_before_the_model_loads(
    base_cfg, monkeypatch
):
    _no_model_load(monkeypatch)
    cfg = {**base_cfg, "finetuning_type": "freeze", "freeze_trainable_layers": 0}
    with pytest.raises(ConfigError, match=r"freeze_trainable_layers: 0 trains no decoder layer"):
        train(None, cfg)


def test_freeze_extra_lm_head_on_a_tied_model_fails_before_the_model_loads(base_cfg, monkeypatch):
    """The tiny model ties its head to the embedding: the one matrix is embed_tokens, and `lm_head` would match
    no parameter and train nothing (LF refuses the name too)."""
    _no_model_load(monkeypatch)
    cfg = {**base_cfg, "finetuning_type": "freeze", "freeze_extra_modules": "lm_head"}
    with pytest.raises(
        ConfigError, match=r"freeze_extra_modules: lm_head is tied to the embedding.*embed_tokens"
    ):
        train(None, cfg)


def test_freeze_extra_modules_naming_no_module_is_refused(base_cfg):
    cfg = {**base_cfg, "finetuning_type": "freeze", "freeze_extra_modules": "embed_tokens,vision_tower"}
    with pytest.raises(ConfigError, match=r"freeze_extra_modules: vision_tower names no module"):
        train(None, cfg)


def test_freeze_extra_embed_tokens_trains_the_embedding_and_the_last_layer(base_cfg, tiny_model):
    cfg = {**base_cfg, "finetuning_type": "freeze", "max_steps": 2, "learning_rate": 1e-3,
           "freeze_trainable_layers": 1, "freeze_extra_modules": "embed_tokens"}  # fmt: skip
    train(None, cfg)
    before = load_file(Path(tiny_model) / "model.safetensors")
    after = load_file(Path(cfg["output_dir"]) / "model.safetensors")
    changed = {k for k, v in before.items() if not torch.equal(v, after[k])}
    assert "model.embed_tokens.weight" in changed and any(".layers.1." in k for k in changed)
    assert not any(".layers.0." in k for k in changed), changed


def _no_model_load(monkeypatch):
    import lmstack.train.sft as sft

    def fail(*a, **k):
        raise AssertionError("the model was loaded before the error")

    monkeypatch.setattr(sft, "load_model", fail)


@pytest.mark.parametrize(
    "change,pattern",
    [
        (
            {"model_name_or_path": "/nonexistent/model"},
            r"model_name_or_path: directory not found: /nonexistent/model",
        ),
        (
            {"dataset": "alpaca_en_dmo"},
            r"dataset: 'alpaca_en_dmo' is not in .*dataset_info.json \(did you mean "
            r"'alpaca_en_demo'\?\)",
        ),
        ({"template": "qwne"}, r"template: got 'qwne'.*did you mean 'qwen'"),
        ({"fp16": True}, r"fp16: needs a CUDA GPU"),
        ({"stage": "sfft"}, r"stage: got 'sfft'; allowed: .*\(did you mean 'sft'\?\)"),
    ],
)
def test_config_errors_before_model_load(base_cfg, monkeypatch, change, pattern):
    _no_model_load(monkeypatch)
    with pytest.raises(LmstackError, match=pattern):
        train(None, {**base_cfg, **change})


def test_missing_data_file_and_all_bad_records(base_cfg, tmp_path, monkeypatch):
    _no_model_load(monkeypatch)
    data = tmp_path / "data"
    data.mkdir()
    (data / "dataset_info.json").write_text(
        json.dumps(
            {
                "gone": {"file_name": "missing.json"},
                "bad": {"file_name": "bad.jsonl", "columns": {"prompt": "instruction", "response": "output"}},
            }
        )
    )
    with pytest.raises(DataError, match=r"\[gone\]: file_name 'missing.json': no such file"):
        train(None, {**base_cfg, "dataset_dir": str(data), "dataset": "gone"})
    (data / "bad.jsonl").write_text('{"instruction": "a"}\n{"output": "b"}\nnot json\n')
    with pytest.raises(DataError) as err:
        train(None, {**base_cfg, "dataset_dir": str(data), "dataset": "bad"})
    msg = str(err.value)
    assert "no trainable record" in msg and "Cannot find valid samples" not in msg
    assert "bad.jsonl line 2, field instruction: missing field" in msg
    assert "bad.jsonl line 3: bad JSON line" in msg
    assert "bad.jsonl line 1, field output: missing field" in msg


def test_output_dir_not_silently_reused(base_cfg):
    out = Path(base_cfg["output_dir"])
    out.mkdir(parents=True)
    (out / "something").write_text("x")
    with pytest.raises(ConfigError, match="output_dir: .* already exists and is not empty"):
        train(None, base_cfg)


def test_seed_yaml_runs_verbatim(tmp_path, tiny_model):
    """Seed 000 §1.2 YAML with only model_name_or_path and output_dir changed (bf16 on CPU via autocast)."""
    text = (REPO / "examples" / "seed_qwen_lora_sft.yaml").read_text()
    out = tmp_path / "seed_out"
    text = text.replace("model_name_or_path: .tiny/qwen2", f"model_name_or_path: {tiny_model}")
    text = text.replace("output_dir: saves/qwen-3b-sft-mini", f"output_dir: {out}")
    shutil.copytree(REPO / "data", tmp_path / "data")
    (tmp_path / "seed.yaml").write_text(text)
    proc = subprocess.run(
        [sys.executable, "-m", "lmstack.cli.main", "train", "seed.yaml", "disable_tqdm=true"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "repeated keys with the same value (kept once): template" in proc.stderr
    assert "Found linear modules: down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj" in proc.stderr
    assert "trainable params:" in proc.stderr
    for name in (
        "adapter_model.safetensors",
        "adapter_config.json",
        "trainer_state.json",
        "trainer_log.jsonl",
        "training_loss.png",
        "checkpoint-20",
    ):
        assert (out / name).exists(), name
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 20


def test_auto_fields_are_resolved_before_training_and_saved(base_cfg):
    import yaml

    cfg = {
        **base_cfg,
        "max_steps": 2,
        "deepspeed": "auto",
        "per_device_train_batch_size": "auto",
        "gradient_checkpointing": "auto",
    }
    train(None, cfg)
    saved = yaml.safe_load((Path(cfg["output_dir"]) / "lmstack_config.yaml").read_text())
    assert saved["deepspeed"] is None and saved["per_device_train_batch_size"] == 1
    assert saved["gradient_checkpointing"] is False
