"""LLaMA-Factory features on the tiny model, each shown to act: OFT adapters (train, save, reload),
LLaMA-Pro (only the expanded blocks train), the DFT / EAFT / ASFT token losses (the logged loss is
the independent computation on the first batch), Adam-mini (one second moment per head / neuron),
do_predict + predict_with_generate (generated_predictions.jsonl and the predict_* metrics),
run_name and gradient_checkpointing_kwargs; plus the rules that refuse impossible combinations
before the model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config
from lmstack.launch.context import LaunchContext
from lmstack.plan.runplan import RunPlan
from lmstack.train.run import train

IDS = torch.tensor([[5, 17, 99, 300, 2, 41, 7]])


@pytest.fixture
def spy(monkeypatch):
    """The real model, optimizer and TrainingArguments the sft stage hands to the Trainer."""
    from lmstack.train import optimizers

    seen: dict = {}
    real = optimizers.create_optimizer

    def recording(cfg, model, args):
        seen.update(model=model, args=args, optimizer=real(cfg, model, args))
        return seen["optimizer"]

    monkeypatch.setattr(optimizers, "create_optimizer", recording)
    return seen


def log_rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines()]


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in log_rows(out) if "loss" in r]


def logits(model, ids=IDS) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(ids.to(next(model.parameters()).device)).logits.float().cpu()


def base_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


# ---- OFT ------------------------------------------------------------------------------------------


def test_oft_trains_rotations_only_saves_and_reloads(base_cfg, tiny_model, spy):
    from peft import PeftModel

    cfg = {**base_cfg, "finetuning_type": "oft", "oft_block_size": 16, "max_steps": 6, "learning_rate": 5e-3}
    train(None, cfg)
    out = Path(cfg["output_dir"])
    curve = losses(out)
    assert curve[-1] < curve[0] - 0.1, curve
    model = spy["model"]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".oft_" in n for n in trainable), trainable
    assert len(trainable) == 14  # the 7 linear layers of each of the 2 decoder blocks
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "OFT" and config["oft_block_size"] == 16 and config["r"] == 0
    assert set(config["target_modules"]) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    }  # fmt: skip
    trained = logits(model)
    reloaded = logits(PeftModel.from_pretrained(base_model(tiny_model), out))
    torch.testing.assert_close(reloaded, trained, atol=1e-5, rtol=0)
    assert not torch.allclose(trained, logits(base_model(tiny_model)), atol=1e-3)  # the rotations moved


def test_oft_in_dpo_trains_and_saves_an_oft_adapter(base_cfg):
    cfg = {**base_cfg, "stage": "dpo", "dataset": "dpo_en_demo", "finetuning_type": "oft", "max_samples": 8}
    train(None, {**cfg, "per_device_train_batch_size": 2, "max_steps": 2, "learning_rate": 1e-3})
    out = Path(cfg["output_dir"])
    assert json.loads((out / "adapter_config.json").read_text())["peft_type"] == "OFT"
    weights = load_file(out / "adapter_model.safetensors")
    assert weights and all(".oft_" in k for k in weights) and any(v.abs().sum() > 0 for v in weights.values())


def test_oft_rank_instead_of_block_size_and_the_plan_treats_oft_as_an_adapter(base_cfg):
    from lmstack.plan.from_config import request_from_plan
    from lmstack.plan.whatif import gpu_context

    plan = RunPlan.resolve(
        build_config({**base_cfg, "finetuning_type": "oft", "bf16": True}), gpu_context(1, 80)
    )
    assert plan.precision.load == "bf16"  # like LoRA: the frozen base stays in bf16 on a GPU
    req = request_from_plan(plan, 1, 80)
    assert req.finetuning_type == "lora" and req.lora_rank == 8  # (32 - 1) / 4 ~ rank 8
    with pytest.raises(
        ConfigError, match=r"oft_rank: 4 and oft_block_size: 32: PEFT's OFT takes exactly one"
    ):
        train(None, {**base_cfg, "finetuning_type": "oft", "oft_rank": 4})


# ---- LLaMA-Pro ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def expanded_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model block-expanded as LLaMA-Factory's llama_pro script does: after each of the 2
    layers a copy of it whose o_proj and down_proj are zero (so it adds nothing): 4 layers, the
    expanded ones are 1 and 3, and the model computes exactly what the original does."""
    import shutil

    from transformers import AutoModelForCausalLM

    original = base_model(tiny_model)
    config = original.config.to_dict()
    config["num_hidden_layers"] = 4
    if config.get("layer_types"):
        config["layer_types"] = [config["layer_types"][0]] * 4
    config = type(original.config).from_dict(config)
    expanded = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    old, new = original.state_dict(), {}
    for name, value in old.items():
        if ".layers." not in name:
            new[name] = value
            continue
        layer = int(name.split(".layers.")[1].split(".")[0])
        rest = name.split(f".layers.{layer}.")[1]
        new[f"model.layers.{2 * layer}.{rest}"] = value
        zero = rest.startswith(("self_attn.o_proj", "mlp.down_proj"))
        new[f"model.layers.{2 * layer + 1}.{rest}"] = torch.zeros_like(value) if zero else value.clone()
    expanded.load_state_dict(new, strict=False)  # tied head
    out = tmp_path_factory.mktemp("pro") / "qwen2-pro"
    expanded.save_pretrained(out)
    for f in Path(tiny_model).iterdir():
        if "token" in f.name or f.name == "chat_template.jinja":
            shutil.copy(f, out / f.name)
    torch.testing.assert_close(logits(base_model(out)), logits(original), atol=1e-5, rtol=0)
    return out


def test_llama_pro_freeze_trains_only_the_expanded_blocks(base_cfg, expanded_model, spy):
    cfg = {
        **base_cfg,
        "model_name_or_path": str(expanded_model),
        "finetuning_type": "freeze",
        "use_llama_pro": True,
        "freeze_trainable_layers": 2,  # 2 expanded blocks among 4 layers: layers 1 and 3
        "learning_rate": 1e-3,
        "max_steps": 3,
    }
    train(None, cfg)
    trainable = {n for n, p in spy["model"].named_parameters() if p.requires_grad}
    layers = {n.split(".layers.")[1].split(".")[0] for n in trainable}
    assert layers == {"1", "3"} and all(".layers." in n for n in trainable)
    assert trainable == {n for n, _ in spy["model"].named_parameters() if n.split(".")[2] in ("1", "3")}
    before = load_file(expanded_model / "model.safetensors")
    after = load_file(Path(cfg["output_dir"]) / "model.safetensors")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and {k.split(".")[2] for k in changed} == {"1", "3"}  # the original blocks are untouched


def test_llama_pro_lora_puts_adapters_on_the_expanded_blocks_only(base_cfg, expanded_model, spy):
    cfg = {**base_cfg, "model_name_or_path": str(expanded_model), "use_llama_pro": True, "max_steps": 2}
    train(None, cfg)
    weights = load_file(Path(cfg["output_dir"]) / "adapter_model.safetensors")
    assert {k.split(".layers.")[1].split(".")[0] for k in weights} == {"1", "3"}
    assert len(weights) == 2 * 7 * 2  # A and B of the 7 linear layers of each expanded block


# ---- DFT / EAFT / ASFT ----------------------------------------------------------------------------


def copy_tokenizer(src: Path, dst: Path) -> None:
    import shutil

    for f in Path(src).iterdir():
        if "token" in f.name or f.name == "chat_template.jinja":
            shutil.copy(f, dst / f.name)


@pytest.fixture(scope="module")
def other_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model with seeded noise on every weight: a reference that disagrees with it."""
    model = base_model(tiny_model)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    out = tmp_path_factory.mktemp("ref") / "qwen2-noisy"
    model.save_pretrained(out)
    copy_tokenizer(tiny_model, out)
    return out


def first_batch(cfg_dict: dict) -> dict:
    """The stage's first micro-batch: its first per_device_train_batch_size rows (disable_shuffling)."""
    from lmstack.data.pipeline import build_datasets
    from lmstack.train.common import PadCollator, tokenizer_and_template

    cfg = build_config(cfg_dict)
    tokenizer, template = tokenizer_and_template(cfg)
    rows = build_datasets(cfg, tokenizer, template).train
    n = cfg.training.per_device_train_batch_size
    return PadCollator(tokenizer.pad_token_id)([rows[i] for i in range(n)])


def by_hand(logits, labels, kind: str, alpha: float = 1.0, ref_logits=None) -> float:
    """The loss written out token by token, in float64: position i predicts labels[i + 1]."""
    total, count = 0.0, 0
    for b in range(labels.shape[0]):
        for i in range(labels.shape[1] - 1):
            target = int(labels[b, i + 1])
            if target == -100:
                continue
            log_p = logits[b, i].double().log_softmax(-1)
            ce = -log_p[target]
            if kind == "ce":
                value = ce
            elif kind == "dft":
                value = ce * log_p[target].exp()
            elif kind == "eaft":
                top = logits[b, i].double().topk(20).values.log_softmax(-1)
                value = ce * (-(top.exp() * top).sum() / 3.0) ** alpha
            else:  # asft
                log_q = ref_logits[b, i].double().log_softmax(-1)
                value = ce * log_p[target].exp() + alpha * (log_q.exp() * (log_q - log_p)).sum()
            total, count = total + float(value), count + 1
    return total / count


def batch_logits(path, batch) -> torch.Tensor:
    with torch.no_grad():
        return base_model(path)(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


LOSS_CASES = [
    ({"use_dft_loss": True}, "dft", 1.0),
    ({"use_eaft_loss": True, "eaft_alpha": 0.5}, "eaft", 0.5),
    ({"use_asft_loss": True, "asft_alpha": 0.3}, "asft", 0.3),  # LoRA: the adapter-off base is the reference
]


@pytest.mark.parametrize("change,kind,alpha", LOSS_CASES, ids=["dft", "eaft", "asft-lora"])
def test_token_loss_is_the_hand_computed_value_on_the_first_batch(base_cfg, tiny_model, change, kind, alpha):
    cfg = {**base_cfg, **change, "disable_shuffling": True, "max_steps": 1}
    plan = RunPlan.resolve(build_config(cfg), LaunchContext())
    name = next(iter(change))
    assert plan.loss_kernel == "none" and plan.reasons["loss_kernel"].startswith(f"{name} needs the logits")
    train(None, cfg)
    batch = first_batch(cfg)
    out = batch_logits(tiny_model, batch)  # a fresh LoRA adapter computes what the base does
    # the adapter-off reference equals the model at step 1: KL 0, so ASFT is DFT there
    expected = by_hand(out, batch["labels"], "dft" if kind == "asft" else kind, alpha, ref_logits=out)
    logged = losses(Path(cfg["output_dir"]))[0]
    assert logged == pytest.approx(expected, rel=1e-4)
    assert abs(logged - by_hand(out, batch["labels"], "ce")) > 0.1  # not the plain cross-entropy


def test_asft_adds_the_kl_to_the_reference_model(base_cfg, tiny_model, other_model):
    cfg = {
        **base_cfg,
        "finetuning_type": "full",
        "use_asft_loss": True,
        "asft_alpha": 0.5,
        "ref_model": str(other_model),
        "disable_shuffling": True,
        "max_steps": 1,
    }
    train(None, cfg)
    batch = first_batch(cfg)
    policy, ref = batch_logits(tiny_model, batch), batch_logits(other_model, batch)
    expected = by_hand(policy, batch["labels"], "asft", 0.5, ref_logits=ref)
    assert losses(Path(cfg["output_dir"]))[0] == pytest.approx(expected, rel=1e-4)
    assert expected - by_hand(policy, batch["labels"], "dft") > 0.01  # the KL term counts


def test_token_losses_match_the_hand_computation_under_gradient_accumulation():
    """The module's functions on random logits: num_items_in_batch normalises (sum / target tokens)."""
    from lmstack.train import losses as L

    gen = torch.Generator().manual_seed(0)
    logits, ref = torch.randn(2, 9, 50, generator=gen), torch.randn(2, 9, 50, generator=gen)
    labels = torch.randint(0, 50, (2, 9), generator=gen)
    labels[:, :3] = -100
    n = int((labels[:, 1:] != -100).sum())
    for kind, fn in (("dft", L.dft_loss), ("eaft", L.eaft_loss)):
        assert float(fn(logits, labels)) == pytest.approx(by_hand(logits, labels, kind), rel=1e-5)
        assert float(fn(logits, labels, torch.tensor(2 * n))) == pytest.approx(
            by_hand(logits, labels, kind) / 2, rel=1e-5
        )
    asft = L.asft_loss(logits, labels, ref, None, 0.2)
    assert float(asft) == pytest.approx(by_hand(logits, labels, "asft", 0.2, ref), rel=1e-5)
    assert float(L.eaft_loss(logits, labels, None, 2.0)) == pytest.approx(
        by_hand(logits, labels, "eaft", 2.0), rel=1e-5
    )


# ---- Adam-mini ------------------------------------------------------------------------------------


def test_adam_mini_keeps_one_second_moment_per_head_and_neuron(base_cfg, tiny_model, spy):
    from adam_mini import Adam_mini
    from transformers import AutoModelForCausalLM

    cfg = {
        **base_cfg,
        "finetuning_type": "full",
        "use_adam_mini": True,
        "learning_rate": 1e-3,
        "max_steps": 6,
    }
    train(None, cfg)
    out = Path(cfg["output_dir"])
    curve = losses(out)
    assert curve[-1] < curve[0] - 0.2, curve
    optimizer, model = spy["optimizer"], spy["model"]
    assert type(optimizer) is Adam_mini
    state = {n: optimizer.state[p] for n, p in model.named_parameters()}
    layer = "model.layers.0."
    assert state[layer + "self_attn.q_proj.weight"]["vmean"].shape == (4, 1)  # one per query head
    assert state[layer + "self_attn.k_proj.weight"]["vmean"].shape == (2, 1)  # one per KV head
    assert state[layer + "mlp.down_proj.weight"]["vmean"].shape == (128, 1)  # one per output neuron
    assert state["model.embed_tokens.weight"]["vmean"].shape[1] == 1  # one per token row
    assert state[layer + "self_attn.q_proj.bias"]["v"].shape == (128,)  # biases: plain Adam
    assert all(g["lr"] == 0.0 for g in optimizer.param_groups)  # the Trainer's linear schedule reached it
    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(saved[name], value.float(), atol=0, rtol=0, msg=name)


# ---- do_predict + predict_with_generate -----------------------------------------------------------


def predict_cfg(base_cfg, **extra) -> dict:
    return {
        **base_cfg,
        "dataset": "alpaca_zh_demo",  # trained on the very examples it predicts: the answers come close
        "eval_dataset": "alpaca_zh_demo",
        "max_samples": 5,
        "per_device_train_batch_size": 5,
        "max_steps": 30,
        "do_predict": True,
        "predict_with_generate": True,
        "do_sample": False,
        "max_new_tokens": 12,
        "per_device_eval_batch_size": 2,
        **extra,
    }


def independent_examples(cfg_dict: dict, tokenizer, template) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) of the eval records, straight from the template (not from lmstack's rows)."""
    from lmstack.data.formats import convert
    from lmstack.data.loader import read_records
    from lmstack.data.registry import get_dataset_attrs

    (attr,) = get_dataset_attrs(cfg_dict["eval_dataset"], cfg_dict["dataset_dir"], "eval_dataset")
    out = []
    for raw in read_records(attr)[: cfg_dict["max_samples"]]:
        ex = convert(raw.data, attr)
        prompt = template.encode_prompt(tokenizer, ex["prompt"], ex.get("system"))
        answer = template.encode_multiturn(tokenizer, ex["prompt"] + ex["response"], ex.get("system"))[-1][1]
        out.append((prompt, answer))
    return out


def lf_scores(pred: str, label: str) -> dict[str, float]:
    import jieba
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu
    from rouge_chinese import Rouge

    hyp, ref = list(jieba.cut(pred)), list(jieba.cut(label))
    if not " ".join(hyp).split() or not " ".join(ref).split():
        rouge = {k: 0.0 for k in ("rouge-1", "rouge-2", "rouge-l")}
    else:
        rouge = {k: v["f"] for k, v in Rouge().get_scores(" ".join(hyp), " ".join(ref))[0].items()}
    bleu = sentence_bleu([list(label)], list(pred), smoothing_function=SmoothingFunction().method3)
    return {**{k: round(v * 100, 4) for k, v in rouge.items()}, "bleu-4": round(bleu * 100, 4)}


def test_do_predict_writes_the_generations_and_lf_metrics(base_cfg, tiny_model):
    from peft import PeftModel

    from lmstack.train.common import tokenizer_and_template

    cfg = predict_cfg(base_cfg)
    metrics = train(None, cfg)
    out = Path(cfg["output_dir"])
    lines = (out / "generated_predictions.jsonl").read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == 5 and all(list(r) == ["prompt", "predict", "label"] for r in rows)
    assert "把下面的数字加一" in lines[0]  # UTF-8, not ASCII escapes
    tokenizer, template = tokenizer_and_template(build_config(cfg))
    model = PeftModel.from_pretrained(base_model(tiny_model), out).eval()
    stop = template.stop_token_ids(tokenizer)
    for row, (prompt, answer) in zip(rows, independent_examples(cfg, tokenizer, template), strict=True):
        assert row["prompt"] == tokenizer.decode(prompt, skip_special_tokens=False)
        assert row["label"] == tokenizer.decode(answer, skip_special_tokens=True)
        with torch.no_grad():
            ids = model.generate(
                input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=12, eos_token_id=stop,
                pad_token_id=tokenizer.pad_token_id,
            )[0, len(prompt):]  # fmt: skip
        assert row["predict"] == tokenizer.decode(ids, skip_special_tokens=True)
    saved = json.loads((out / "predict_results.json").read_text())
    per_example = [lf_scores(r["predict"], r["label"]) for r in rows]
    for key in ("bleu-4", "rouge-1", "rouge-2", "rouge-l"):
        expected = sum(s[key] for s in per_example) / len(rows)
        assert saved[f"predict_{key}"] == pytest.approx(expected) == metrics[f"predict_{key}"]
    assert saved["predict_rouge-1"] > 0 and saved["predict_bleu-4"] > 0
    assert {"predict_runtime", "predict_samples_per_second", "predict_steps_per_second"} <= set(saved)
    everything = json.loads((out / "all_results.json").read_text())
    assert "train_loss" in everything and everything["predict_rouge-l"] == saved["predict_rouge-l"]


def test_predict_alone_with_do_train_false_uses_the_trained_adapter(base_cfg, tmp_path):
    trained = predict_cfg(base_cfg, output_dir=str(tmp_path / "trained"))
    train(None, trained)
    alone = predict_cfg(
        base_cfg,
        do_train=False,
        dataset=None,
        adapter_name_or_path=trained["output_dir"],
        output_dir=str(tmp_path / "predict"),
    )
    metrics = train(None, alone)
    first = (tmp_path / "trained" / "generated_predictions.jsonl").read_text(encoding="utf-8")
    assert (tmp_path / "predict" / "generated_predictions.jsonl").read_text(encoding="utf-8") == first
    assert not (tmp_path / "predict" / "adapter_model.safetensors").exists()  # nothing trained
    assert (
        metrics["predict_bleu-4"]
        == json.loads((tmp_path / "trained" / "predict_results.json").read_text())["predict_bleu-4"]
    )


def test_lf_similarity_scores_identical_text_100_and_empty_text_0():
    from lmstack.train.predict import similarity

    assert similarity(["今天天气很好"], ["今天天气很好"]) == {
        "rouge-1": 100.0, "rouge-2": 100.0, "rouge-l": 100.0, "bleu-4": 100.0
    }  # fmt: skip
    zero = similarity([""], ["今天天气很好"])
    assert zero["rouge-1"] == zero["rouge-l"] == 0.0


# ---- run_name, gradient_checkpointing_kwargs ------------------------------------------------------


def test_run_name_reaches_the_trainer(base_cfg, spy):
    train(None, {**base_cfg, "run_name": "lf-run-7", "max_steps": 1})
    assert spy["args"].run_name == "lf-run-7"


def checkpoint_functions(model) -> list:
    return [
        m._gradient_checkpointing_func for m in model.modules() if getattr(m, "gradient_checkpointing", False)
    ]


@pytest.mark.parametrize("kwargs,reentrant", [(None, True), ({"use_reentrant": False}, False)])
def test_gradient_checkpointing_kwargs_win_over_use_reentrant_gc(base_cfg, spy, kwargs, reentrant):
    cfg = {**base_cfg, "gradient_checkpointing": True, "use_reentrant_gc": True, "max_steps": 2}
    if kwargs:
        cfg["gradient_checkpointing_kwargs"] = kwargs
    train(None, cfg)
    funcs = checkpoint_functions(spy["model"])
    assert len(funcs) >= 2  # every decoder layer recomputes
    assert all(f.keywords["use_reentrant"] is reentrant for f in funcs)


def test_gradient_checkpointing_kwargs_without_checkpointing_is_said_to_have_no_effect(base_cfg):
    from lmstack.train.run import plan_run

    _, notes = plan_run(build_config({**base_cfg, "gradient_checkpointing_kwargs": {"use_reentrant": False}}))
    assert any(n.startswith("gradient_checkpointing_kwargs: has no effect") for n in notes), notes


# ---- rules: refused before the model loads --------------------------------------------------------


@pytest.fixture
def no_model_load(monkeypatch):
    import lmstack.models.load as load

    def fail(*a, **k):
        raise AssertionError("the model was loaded before the error")

    monkeypatch.setattr(load, "load_model", fail)
    monkeypatch.setattr("lmstack.train.sft.load_model", fail)


RULES = [
    ({"finetuning_type": "oft", "oft_block_size": 0}, r"oft_rank: 0 and oft_block_size: 0: PEFT's OFT takes"),
    (
        {"finetuning_type": "oft", "lora_target": "q_proj"},
        r"lora_target: 'q_proj' with finetuning_type: oft.*oft_target: q_proj",
    ),
    (
        {"finetuning_type": "oft", "use_galore": True},
        r"use_galore: a full-parameter optimizer, not for finetuning_type: oft",
    ),
    ({"finetuning_type": "oft", "use_dora": True}, r"use_dora: a LoRA option, but finetuning_type is oft"),
    ({"finetuning_type": "full", "use_llama_pro": True}, r"use_llama_pro: .*not full"),
    (
        {"finetuning_type": "freeze", "use_llama_pro": True, "freeze_trainable_layers": 3},
        r"freeze_trainable_layers: got 3 with use_llama_pro; .*divide the model's 2 layers \(e.g. 1, 2\)",
    ),
    (
        {"finetuning_type": "freeze", "use_llama_pro": True, "freeze_trainable_layers": -1},
        r"freeze_trainable_layers: got -1 with use_llama_pro",
    ),
    ({"use_adam_mini": True}, r"use_adam_mini: a full-parameter optimizer, not for finetuning_type: lora"),
    (
        {"finetuning_type": "full", "use_adam_mini": True, "use_galore": True},
        r"use_galore and use_adam_mini: use one",
    ),
    ({"finetuning_type": "full", "use_adam_mini": True, "optim": "sgd"}, r"use_adam_mini and optim: 'sgd'"),
    (
        {"use_dft_loss": True, "use_eaft_loss": True},
        r"use_dft_loss and use_eaft_loss: one token loss at a time",
    ),
    (
        {"stage": "pt", "dataset": "c4_demo", "use_dft_loss": True},
        r"use_dft_loss: a stage sft loss, not available for stage: pt",
    ),
    ({"do_predict": True}, r"do_predict: stage sft predicts by generating; set predict_with_generate: true"),
    ({"do_predict": True, "predict_with_generate": True}, r"do_predict: needs eval_dataset"),
    (
        {"do_predict": True, "predict_with_generate": True, "val_size": 2, "compute_accuracy": True},
        r"predict_with_generate and compute_accuracy",
    ),
    (
        {"predict_with_generate": True, "eval_dataset": "identity", "do_eval": True},
        r"predict_with_generate with evaluation",
    ),
    (
        {"stage": "pt", "dataset": "c4_demo", "do_predict": True},
        r"do_predict: lmstack predicts for stage: sft only",
    ),
    (
        {"gradient_checkpointing_kwargs": {"use_reentrnt": False}},
        r"gradient_checkpointing_kwargs: unknown key 'use_reentrnt'",
    ),
    (
        {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"debug": True}},
        r"debug works with non-reentrant checkpointing only",
    ),
]


@pytest.mark.parametrize("change,pattern", RULES, ids=[str(i) for i in range(len(RULES))])
def test_rules_refuse_before_the_model_loads(base_cfg, no_model_load, change, pattern):
    with pytest.raises(ConfigError, match=pattern):
        train(None, {**base_cfg, **change})


def test_asft_with_a_frozen_reference_copy_is_refused_when_sharded(base_cfg, tmp_path):
    from lmstack.plan.rules import sharded_asft_reference
    from lmstack.plan.runplan import FsdpPlan

    plan = RunPlan.resolve(
        build_config({**base_cfg, "finetuning_type": "full", "use_asft_loss": True}), LaunchContext()
    )
    assert sharded_asft_reference(plan) is None
    from dataclasses import replace

    with pytest.raises(ConfigError, match="use_asft_loss: its frozen reference model"):
        sharded_asft_reference(replace(plan, fsdp=FsdpPlan("yaml", "FULL_SHARD")))
