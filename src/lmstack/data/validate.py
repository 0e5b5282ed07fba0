"""`lmstack check`: what the training data looks like to the trainer, without loading the model.

`check_data(cfg, tokenizer, template)` returns a JSON-able report:
  datasets[]: name, split (dataset | eval_dataset), records, kept, dropped {kind: n}, truncated,
              trainable_tokens, lengths {prompt, response, total: {p50, p95, max}} (tokens before
              truncation; prompt = masked tokens, response = trained tokens), problems[] (file,
              position = "record i" / "line n" / "row i", field path, kind, reason)
  totals: the same counts summed; example: one encoded training sample as segments
  [{text, trained}] so the loss mask can be seen.
The drop counts are computed exactly as `build_datasets` computes them (same functions), so
`check` and `train` always agree.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import numpy as np

from lmstack.config.schema import Config
from lmstack.data.encode import IGNORE_INDEX
from lmstack.data.pipeline import (
    DatasetStats,
    check_data_args,
    check_ranking,
    encode_options,
    encode_records,
    format_dropped,
    format_problem,
    load_one,
    read_limited,
)
from lmstack.data.registry import get_dataset_attrs
from lmstack.data.tokenized import TokenizedDataset

UNLIMITED = 10**9
MAX_PRINTED_PROBLEMS = 50


def _percentiles(values: np.ndarray) -> dict:
    if len(values) == 0:
        return {"p50": 0, "p95": 0, "max": 0}
    return {
        "p50": int(np.percentile(values, 50)),
        "p95": int(np.percentile(values, 95)),
        "max": int(values.max()),
    }


def _labels_key(data: TokenizedDataset) -> str | None:
    keys = sorted(k for k in data.ragged if k.endswith("labels"))
    return "labels" if "labels" in keys else (keys[0] if keys else None)


def _per_sample(data: TokenizedDataset, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(masked, trained) token counts per sample of a labels column."""
    values, offsets = data.ragged[key]
    trained = np.concatenate([[0], np.cumsum(values != IGNORE_INDEX)])
    n_trained = trained[offsets[1:]] - trained[offsets[:-1]]
    return np.diff(offsets) - n_trained, n_trained


def length_stats(data: TokenizedDataset) -> dict:
    key = _labels_key(data)
    if key is None:  # prompt-only samples (ppo/grpo): everything is prompt
        lengths = data.lengths()
        return {
            "prompt": _percentiles(lengths),
            "response": _percentiles(0 * lengths),
            "total": _percentiles(lengths),
        }
    masked, trained = _per_sample(data, key)
    return {
        "prompt": _percentiles(masked),
        "response": _percentiles(trained),
        "total": _percentiles(masked + trained),
    }


def example_segments(data: TokenizedDataset, tokenizer: Any) -> list[dict]:
    """The first sample split into runs of trained / masked tokens, each decoded to text."""
    key = _labels_key(data)
    if key is None or len(data) == 0:
        return []
    sample = data[0]
    ids_key = key[: -len("labels")] + "input_ids"
    ids, labels = sample[ids_key], sample[key]
    segments: list[dict] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or (labels[i] != IGNORE_INDEX) != (labels[start] != IGNORE_INDEX):
            text = tokenizer.decode(ids[start:i], skip_special_tokens=False)
            segments.append({"text": text, "trained": labels[start] != IGNORE_INDEX})
            start = i
    return segments


def check_data(cfg: Config, tokenizer: Any, template: Any) -> dict:
    check_data_args(cfg)
    opts = encode_options(cfg)
    unlimited = dataclasses.replace(opts, cutoff_len=UNLIMITED)
    report: dict = {
        "stage": cfg.finetuning.stage,
        "template": getattr(template, "name", None),
        "cutoff_len": cfg.data.cutoff_len,
        "datasets": [],
        "example": [],
    }
    for split, names in (("dataset", cfg.data.dataset), ("eval_dataset", cfg.data.eval_dataset)):
        for attr in get_dataset_attrs(names, cfg.data.dataset_dir, split):
            check_ranking(attr, cfg.finetuning.stage)
            data, stats = load_one(cfg, attr, tokenizer, template, opts)
            full = data  # nothing was cut: these are the real lengths
            if stats.truncated:  # encode again without cutoff_len to see how long the records are
                full, _ = encode_records(
                    read_limited(attr, cfg.data.max_samples),
                    attr,
                    tokenizer,
                    template,
                    unlimited,
                    cfg.data.preprocessing_num_workers or 1,
                    cfg.data.preprocessing_batch_size,
                )
            entry = stats.to_dict()
            entry.update(
                split=split,
                source=attr.source,
                trainable_tokens=data.trainable_tokens(),
                lengths=length_stats(full),
            )
            report["datasets"].append(entry)
            if not report["example"] and split == "dataset":
                report["example"] = example_segments(data, tokenizer)
                report["example_dataset"] = attr.name
    report["totals"] = _totals(report["datasets"])
    return report


def _totals(datasets: list[dict]) -> dict:
    dropped: Counter = Counter()
    for d in datasets:
        dropped.update(d["dropped"])
    return {
        "records": sum(d["records"] for d in datasets),
        "kept": sum(d["kept"] for d in datasets),
        "dropped": dict(dropped),
        "truncated": sum(d["truncated"] for d in datasets),
        "trainable_tokens": sum(d["trainable_tokens"] for d in datasets),
        "problems": sum(len(d["problems"]) for d in datasets),
    }


# ---- text rendering ----------------------------------------------------------------------------
TRAINED_TTY, MASKED_TTY, RESET = "\033[1;32m", "\033[2m", "\033[0m"


def render_example(segments: list[dict], color: bool) -> str:
    out = []
    for seg in segments:
        if seg["trained"]:
            out.append(f"{TRAINED_TTY}{seg['text']}{RESET}" if color else f"«{seg['text']}»")
        else:
            out.append(f"{MASKED_TTY}{seg['text']}{RESET}" if color else seg["text"])
    return "".join(out)


def format_report(report: dict, color: bool = False) -> str:
    lines = [f"stage {report['stage']}, template {report['template']}, cutoff_len {report['cutoff_len']}", ""]
    for d in report["datasets"]:
        dropped = sum(d["dropped"].values())
        lines.append(
            f"{d['name']} ({d['split']}): {d['records']} records, {d['kept']} kept, {dropped} dropped"
            + (f" ({format_dropped(DatasetStats.from_dict(d))})" if dropped else "")
            + f", {d['truncated']} truncated, {d['trainable_tokens']} trainable tokens"
        )
        for part in ("prompt", "response", "total"):
            p = d["lengths"][part]
            lines.append(
                f"    {part + ' tokens':<16} p50 {p['p50']:>6}  p95 {p['p95']:>6}  max {p['max']:>6}"
            )
        for p in d["problems"][:MAX_PRINTED_PROBLEMS]:
            lines.append(f"    problem: {format_problem(p)}")
        if len(d["problems"]) > MAX_PRINTED_PROBLEMS:
            lines.append(f"    ... and {len(d['problems']) - MAX_PRINTED_PROBLEMS} more in data_report.json")
    t = report["totals"]
    lines += [
        "",
        f"total: {t['records']} records, {t['kept']} kept, {sum(t['dropped'].values())} dropped, "
        f"{t['truncated']} truncated, {t['trainable_tokens']} trainable tokens, {t['problems']} problems",
    ]
    if report["example"]:
        legend = "trained tokens in bold green, masked ones dimmed" if color else "trained tokens inside « »"
        lines += ["", f"training example from {report['example_dataset']} ({legend}):", ""]
        lines.append(render_example(report["example"], color))
    return "\n".join(lines)
