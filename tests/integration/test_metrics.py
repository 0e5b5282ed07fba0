"""`compute_accuracy`: eval_accuracy = LF's token accuracy over the trained tokens, checked against the
model's own logits on the eval set; the warnings when it has no effect; Liger's fused forward in eval."""

import json
import logging
import re
from pathlib import Path

import pytest
import torch

from lmstack.config.load import load_config
from lmstack.train import common
from lmstack.train.run import plan_run, train


def eval_rows(cfg_dict: dict) -> list[dict]:
    """The eval split exactly as the run built it (same config, same seed)."""
    from lmstack.data.pipeline import build_datasets

    cfg = load_config(None, cfg_dict)
    tokenizer, template = common.tokenizer_and_template(cfg)
    evals = build_datasets(cfg, tokenizer, template).eval
    return [evals[i] for i in range(len(evals))]


def accuracy_from_logits(model, rows: list[dict], shift: bool = True) -> float:
    """Per row: argmax of the logits at t against the label at t + 1 on trained labels; mean of the rows."""
    scores = []
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["input_ids"]], device=model.device)
            labels = torch.tensor(row["labels"], device=model.device)
            pred = model(input_ids=ids).logits[0].argmax(-1)
            pred, labels = (pred[:-1], labels[1:]) if shift else (pred, labels)
            trained = labels != -100
            if trained.any():
                scores.append((pred[trained] == labels[trained]).double().mean().item())
    return sum(scores) / len(scores)


def trained_lora_model(base: Path, out: Path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return PeftModel.from_pretrained(model, out).eval()


def test_sft_compute_accuracy_equals_token_accuracy_of_the_models_logits(base_cfg, tiny_model, caplog):
    cfg = {
        **base_cfg,
        "max_steps": 8,
        "val_size": 0.2,
        "do_eval": True,
        "eval_strategy": "steps",
        "eval_steps": 4,
        "per_device_eval_batch_size": 1,  # rows of different lengths: the Trainer pads across batches
        "compute_accuracy": True,
        "plot_loss": True,
    }
    with caplog.at_level(logging.INFO):
        train(None, cfg)
    assert "chunked linear CE" in caplog.text  # the fused training forward still gives logits in eval
    assert "compute_accuracy: has no effect" not in caplog.text
    out = Path(cfg["output_dir"])
    accuracy = json.loads((out / "eval_results.json").read_text())["eval_accuracy"]
    assert 0.0 <= accuracy <= 1.0

    rows = eval_rows(cfg)
    assert len(rows) >= 4
    model = trained_lora_model(tiny_model, out)
    assert accuracy == pytest.approx(accuracy_from_logits(model, rows), abs=1e-9)
    # the check can tell a missing causal shift apart
    assert abs(accuracy_from_logits(model, rows, shift=False) - accuracy) > 1e-3

    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert [h["step"] for h in history if "eval_accuracy" in h] == [4, 8]  # eval_strategy: steps
    assert (out / "training_eval_accuracy.png").read_bytes()[:4] == b"\x89PNG"
    for line in (out / "trainer_log.jsonl").read_text().splitlines():  # LF's log keys: no eval_accuracy
        assert "eval_accuracy" not in json.loads(line)


def test_compute_accuracy_without_effect_warns_once(base_cfg, caplog):
    cases = [
        ({"compute_accuracy": True}, "without evaluation data"),
        ({"compute_accuracy": True, "val_size": 0.1}, "nothing is evaluated"),
    ]
    for extra, words in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            plan_run(load_config(None, {**base_cfg, **extra}))
        notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compute_accuracy:")]
        assert len(notes) == 1 and words in notes[0], (extra, notes)
    for extra in (
        {"compute_accuracy": True, "val_size": 0.1, "do_eval": True},
        {"compute_accuracy": True, "val_size": 0.1, "eval_strategy": "steps", "stage": "pt"},
        {"val_size": 0.1, "stage": "dpo", "dataset": "dpo_en_demo"},
    ):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            plan_run(load_config(None, {**base_cfg, **extra}))
        assert "compute_accuracy" not in caplog.text, extra


@pytest.mark.parametrize(
    "stage,words",
    [("dpo", "stage dpo; token accuracy"), ("rm", r"stage rm \(it reports its own pairwise eval_accuracy\)")],
)
def test_compute_accuracy_on_a_stage_without_token_accuracy_warns(base_cfg, stage, words):
    extra = {
        "compute_accuracy": True,
        "val_size": 0.1,
        "do_eval": True,
        "stage": stage,
        "dataset": "dpo_en_demo",
    }
    _, notes = plan_run(load_config(None, {**base_cfg, **extra}))
    assert any(re.search(rf"compute_accuracy: has no effect for {words}", n) for n in notes), notes


def test_row_accuracy_scores_the_shifted_trained_labels_and_skips_empty_rows():
    from lmstack.train.metrics import TokenAccuracy, argmax_ids, row_accuracies

    labels = torch.tensor([[-100, 5, 6, 7], [-100, -100, -100, -100], [-100, -100, 3, -100]])
    preds = torch.tensor([[5, 9, 7, 0], [1, 1, 1, 1], [0, 3, 0, 0]])  # pred[t] is scored against label[t+1]
    assert row_accuracies(preds, labels) == [2 / 3, 1.0]
    metric = TokenAccuracy()  # batch_eval_metrics: rows collected until compute_result
    assert metric(_Pred(preds[:1], labels[:1]), compute_result=False) is None
    assert metric(_Pred(preds[1:], labels[1:]), compute_result=True) == {"accuracy": pytest.approx(5 / 6)}
    logits = torch.randn(2, 3, 11)
    aux = torch.tensor(0.5)  # MoE outputs: (aux_loss, logits, ...)
    assert torch.equal(argmax_ids((aux, logits), None), logits.argmax(-1).to(torch.int32))


class _Pred:
    def __init__(self, predictions, label_ids):
        self.predictions, self.label_ids = predictions, label_ids


@pytest.mark.gpu
def test_liger_fused_forward_returns_logits_in_eval_and_eval_accuracy(base_cfg, tiny_model, tmp_path, caplog):
    pytest.importorskip("liger_kernel")
    from transformers import AutoModelForCausalLM

    from lmstack.models.load import apply_liger_kernel

    ids = torch.randint(0, 200, (2, 16), device="cuda")
    labels = ids.clone()
    labels[:, :4] = -100
    plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).cuda().eval()
    patched = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).cuda().eval()
    apply_liger_kernel(patched, fused_ce=True)  # the run plan has already checked the package and family
    assert getattr(patched.forward, "__func__", patched.forward).__module__.startswith("liger_kernel")
    with torch.no_grad():
        want, got = plain(input_ids=ids, labels=labels), patched(input_ids=ids, labels=labels)
    assert got.logits is not None and got.logits.shape == want.logits.shape
    assert torch.allclose(got.logits.float(), want.logits.float(), atol=1e-3)
    assert torch.allclose(got.loss, want.loss, atol=1e-4)

    run = {**base_cfg, "output_dir": str(tmp_path / "liger"), "enable_liger_kernel": True, "max_steps": 8,
           "val_size": 0.2, "do_eval": True, "per_device_eval_batch_size": 1, "compute_accuracy": True}  # fmt: skip
    with caplog.at_level(logging.INFO):
        train(None, run)  # fp32 on the GPU (no bf16), so the fp32 CPU reference below agrees
    assert "Liger kernels applied to qwen2 (fused linear cross-entropy)" in caplog.text
    accuracy = json.loads((tmp_path / "liger" / "eval_results.json").read_text())["eval_accuracy"]
    # the fp32 reference runs on the GPU: Liger's patch is process-wide (the Qwen2 module's norm/rope/SwiGLU
    # are replaced), and its Triton kernels cannot read CPU tensors
    model = trained_lora_model(tiny_model, tmp_path / "liger").cuda()
    assert accuracy == pytest.approx(accuracy_from_logits(model, eval_rows(run)), abs=0.02)
