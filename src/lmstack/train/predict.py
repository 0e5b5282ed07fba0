"""Stage sft's `do_predict` with `predict_with_generate` (LLaMA-Factory's batch prediction): after
training, or alone with `do_train: false`, the model answers every example of the evaluation data
(`eval_dataset`, or the `val_size` split of `dataset`) and the run writes

- `generated_predictions.jsonl`: one {"prompt", "predict", "label"} object per example, in that order:
  the prompt ids decoded with the special tokens, the generated answer and the reference answer
  decoded with `skip_special_tokens` (UTF-8, one line each);
- `predict_results.json` (merged into `all_results.json`): LLaMA-Factory's `predict_bleu-4`,
  `predict_rouge-1`, `predict_rouge-2`, `predict_rouge-l`, each the mean of per-example scores x 100
  (ROUGE F on jieba words via rouge-chinese, sentence BLEU-4 on characters with NLTK's smoothing
  method 3; an empty prediction or reference scores ROUGE 0), plus `predict_runtime`,
  `predict_samples_per_second` and `predict_steps_per_second`.

The prompt of an example is everything before its last answer (history turns included), the label
that answer (the template's closing tokens included), both from the sft encoding with
`train_on_prompt` off. Generation uses the generating fields (sampling by default, as in LLaMA-Factory),
batches of `per_device_eval_batch_size` prompts padded on the left, stopping at the template's stop
tokens; it runs in the main process (other processes wait).
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from lmstack.config.schema import Config
from lmstack.data.encode import IGNORE_INDEX
from lmstack.plan.runplan import RunPlan

logger = logging.getLogger(__name__)
PREDICTIONS_FILE = "generated_predictions.jsonl"
METRIC_KEYS = ("rouge-1", "rouge-2", "rouge-l", "bleu-4")


def split_last_answer(input_ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
    """(prompt, answer) of an sft row: the answer is the last run of trained tokens."""
    end = max(i for i, label in enumerate(labels) if label != IGNORE_INDEX) + 1
    start = end - 1
    while start > 0 and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    return list(input_ids[:start]), list(input_ids[start:end])


def prediction_rows(cfg: Config, tokenizer: Any, template: Any) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, reference answer ids) of every evaluation example."""
    from lmstack.data.pipeline import build_datasets, load_split

    data_cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"train_on_prompt": False})})
    if cfg.data.eval_dataset:
        data, _ = load_split(data_cfg, cfg.data.eval_dataset, "eval_dataset", tokenizer, template, mix=False)
    else:
        data = build_datasets(data_cfg, tokenizer, template).eval
    rows = [data[i] for i in range(len(data))] if data is not None else []
    return [split_last_answer(list(r["input_ids"]), list(r["labels"])) for r in rows]


def generation_config(cfg: Config, model: Any, tokenizer: Any, template: Any) -> Any:
    from transformers import GenerationConfig

    from lmstack.infer.engine import stop_token_ids

    g = cfg.generating
    opts: dict = {"do_sample": g.do_sample, "num_beams": g.num_beams, "max_new_tokens": g.max_new_tokens}
    opts["repetition_penalty"] = g.repetition_penalty
    if g.do_sample:
        opts.update(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k)
    return GenerationConfig(
        **opts,
        eos_token_id=stop_token_ids(model, tokenizer, template),
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )


def generate(model: Any, prompts: list[list[int]], batch_size: int, gen: Any, pad_id: int) -> list[list[int]]:
    """The generated ids (prompt excluded) of each prompt, in order; prompts padded on the left."""
    import torch

    device = next(model.parameters()).device
    outputs: list[list[int]] = []
    model.eval()
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.no_grad():
            out = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen
            )
        outputs += [row[width:].tolist() for row in out.cpu()]
    return outputs


def similarity(predictions: list[str], references: list[str]) -> dict[str, float]:
    """LLaMA-Factory's generation metrics: per-example ROUGE-1/2/L F on jieba words and sentence BLEU-4
    on characters (smoothing method 3), x 100 and rounded to 4 decimals, averaged over the examples."""
    import jieba
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu
    from rouge_chinese import Rouge

    jieba.setLogLevel(logging.WARNING)  # its dictionary-loading lines, once per process
    scores: dict[str, list[float]] = {k: [] for k in METRIC_KEYS}
    for pred, label in zip(predictions, references, strict=True):
        hypothesis, reference = " ".join(jieba.cut(pred)), " ".join(jieba.cut(label))
        if not hypothesis.split() or not reference.split():
            rouge = {k: {"f": 0.0} for k in METRIC_KEYS[:3]}
        else:
            rouge = Rouge().get_scores(hypothesis, reference)[0]
        for key in METRIC_KEYS[:3]:
            scores[key].append(round(rouge[key]["f"] * 100, 4))
        bleu = sentence_bleu([list(label)], list(pred), smoothing_function=SmoothingFunction().method3)
        scores["bleu-4"].append(round(bleu * 100, 4))
    return {k: (sum(v) / len(v) if v else 0.0) for k, v in scores.items()}


def write_predictions(output_dir: str, prompts: list[str], preds: list[str], labels: list[str]) -> Path:
    path = Path(output_dir) / PREDICTIONS_FILE
    with path.open("w", encoding="utf-8") as fh:
        for prompt, pred, label in zip(prompts, preds, labels, strict=True):
            fh.write(
                json.dumps({"prompt": prompt, "predict": pred, "label": label}, ensure_ascii=False) + "\n"
            )
    return path


def save_metrics(output_dir: str, split: str, metrics: dict) -> None:
    """`<split>_results.json`, merged into `all_results.json` (what transformers' save_metrics writes)."""
    out = Path(output_dir)
    (out / f"{split}_results.json").write_text(json.dumps(metrics, indent=4, sort_keys=True))
    everything = out / "all_results.json"
    merged = json.loads(everything.read_text()) if everything.is_file() else {}
    merged.update(metrics)
    everything.write_text(json.dumps(merged, indent=4, sort_keys=True))


def predict(plan: RunPlan, model: Any, tokenizer: Any, template: Any) -> dict:
    """Generate for the evaluation data; writes the two files and returns the predict_* metrics
    (an empty dict in the processes other than the main one)."""
    from lmstack.launch.dist import barrier

    cfg = plan.cfg
    metrics: dict = {}
    if plan.is_main:
        metrics = _predict(cfg, model, tokenizer, template)
    barrier()
    return metrics


def _predict(cfg: Config, model: Any, tokenizer: Any, template: Any) -> dict:
    rows = prediction_rows(cfg, tokenizer, template)
    if not rows:
        logger.warning("do_predict: the evaluation data has no example; nothing to predict")
        return {}
    from transformers import set_seed

    set_seed(cfg.training.seed)  # sampling (the default) draws the same answers on every run
    batch = cfg.training.per_device_eval_batch_size
    started = time.time()
    generated = generate(
        model,
        [p for p, _ in rows],
        batch,
        generation_config(cfg, model, tokenizer, template),
        tokenizer.pad_token_id,
    )
    runtime = time.time() - started
    skip = cfg.generating.skip_special_tokens
    prompts = tokenizer.batch_decode([p for p, _ in rows], skip_special_tokens=False)
    preds = tokenizer.batch_decode(generated, skip_special_tokens=skip)
    labels = tokenizer.batch_decode([a for _, a in rows], skip_special_tokens=skip)
    path = write_predictions(cfg.training.output_dir, prompts, preds, labels)
    logger.info("wrote %s (%d predictions)", path, len(rows))
    metrics = {f"predict_{k}": v for k, v in similarity(preds, labels).items()}
    metrics.update(
        predict_runtime=round(runtime, 4),
        predict_samples_per_second=round(len(rows) / runtime, 3) if runtime else 0.0,
        predict_steps_per_second=round(math.ceil(len(rows) / batch) / runtime, 3) if runtime else 0.0,
    )
    save_metrics(cfg.training.output_dir, "predict", metrics)
    for key, value in metrics.items():
        logger.info("  %s = %s", key, value)
    return metrics


def run_predict_only(plan: RunPlan) -> dict:
    """`do_train: false` with do_predict: the model of model_name_or_path (with adapter_name_or_path
    merged, the last adapter loaded) answers the evaluation data."""
    from lmstack.models.adapters import apply_lora
    from lmstack.models.load import load_model
    from lmstack.train import common

    cfg = plan.cfg
    common.start_run(plan)
    Path(cfg.training.output_dir).mkdir(parents=True, exist_ok=True)
    tokenizer, template = common.tokenizer_and_template(cfg)
    model = load_model(plan.model_spec(), tokenizer)
    if cfg.model.adapter_name_or_path:
        model = apply_lora(cfg, model, is_trainable=False)
    model.to(_device(plan))
    return predict(plan, model, tokenizer, template)


def _device(plan: RunPlan) -> str:
    return f"cuda:{plan.ctx.local_rank}" if plan.device == "cuda" else "cpu"
