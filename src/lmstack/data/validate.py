"""`lmstack check`: what the training data looks like to the trainer, without loading the model.

`check_data(cfg, tokenizer, template, pt_split=False)` returns a JSON-able report:
  datasets[]: name, split (dataset | eval_dataset), records, kept, dropped {kind: n}, truncated,
              trainable_tokens, lengths {prompt, response, total: {p50, p95, max}} (tokens before
              truncation; prompt = masked tokens, response = trained tokens), problems[] (file,
              position = "record i" / "line n" / "row i", field path, kind, reason),
              fields_cut (text fields longer than field_chars = 32 x cutoff_len characters, cut
              before tokenizing; their lengths are those of the kept part)
              with pt_split also: split_texts (texts longer than cutoff_len), pieces (rows after
              cutting them into cutoff_len pieces); truncated is then 0
  totals: the same counts summed; example: one encoded training sample as segments
  [{text, trained}] so the loss mask can be seen; example_media: its media files {images | videos |
  audios: [absolute path]} (a multimodal dataset only).
The drop counts are computed exactly as `build_datasets` computes them (same functions), so
`check` and `train` always agree. `pt_split=True` is for stage pt trained packed (train/pt.py):
there a long text is encoded whole and split into cutoff_len pieces, nothing truncated or dropped.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from typing import Any

import numpy as np

from lmstack.config.schema import Config
from lmstack.data.encode import IGNORE_INDEX
from lmstack.data.mm import format_media, media_stats
from lmstack.data.mm_av import av_stats, format_av
from lmstack.data.pipeline import check_data_args, encode_records, load_one, read_limited
from lmstack.data.registry import DatasetAttr, get_dataset_attrs
from lmstack.data.stats import (
    CONTROL,
    WHOLE_TEXT,
    DatasetStats,
    check_ranking,
    control_warning,
    encode_options,
    format_dropped,
    format_fields_cut,
    format_problem,
    placeholder_warning,
    truncation_warning,
)
from lmstack.data.tokenized import TokenizedDataset

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


def example_segments(data: TokenizedDataset, tokenizer: Any, limit: int | None = None) -> list[dict]:
    """The first sample (its first `limit` tokens: one cutoff_len piece of a long pt text) split into
    runs of trained / masked tokens, each decoded to text."""
    key = _labels_key(data)
    if key is None or len(data) == 0:
        return []
    sample = data[0]
    ids_key = key[: -len("labels")] + "input_ids"
    ids, labels = sample[ids_key][:limit], sample[key][:limit]
    segments: list[dict] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or (labels[i] != IGNORE_INDEX) != (labels[start] != IGNORE_INDEX):
            text = tokenizer.decode(ids[start:i], skip_special_tokens=False)
            segments.append({"text": text, "trained": labels[start] != IGNORE_INDEX})
            start = i
    return segments


def check_data(cfg: Config, tokenizer: Any, template: Any, *, pt_split: bool = False) -> dict:
    """The report of every dataset of `dataset` and `eval_dataset`. `pt_split` (stage pt only): the
    texts are cut into cutoff_len pieces as packed pt training does (train/pt.py), not truncated."""
    if pt_split and cfg.finetuning.stage != "pt":
        raise ValueError(f"pt_split is for stage pt, not {cfg.finetuning.stage}")
    check_data_args(cfg)
    attrs = [  # every entry parsed (and a refused one reported) before anything is tokenized
        (split, attr)
        for split, names in (("dataset", cfg.data.dataset), ("eval_dataset", cfg.data.eval_dataset))
        for attr in get_dataset_attrs(names, cfg.data.dataset_dir, split)
    ]
    for _, attr in attrs:
        check_ranking(attr, cfg.finetuning.stage)
    report: dict = {
        "stage": cfg.finetuning.stage,
        "template": getattr(template, "name", None),
        "cutoff_len": cfg.data.cutoff_len,
        "pt_split": pt_split,
        "datasets": [],
        "example": [],
    }
    for split, attr in attrs:
        entry, data = (_split_entry if pt_split else _entry)(cfg, attr, tokenizer, template)
        entry.update(split=split, source=attr.source)
        report["datasets"].append(entry)
        if not report["example"] and split == "dataset":
            report["example"] = example_segments(data, tokenizer, limit=cfg.data.cutoff_len)
            report["example_dataset"] = attr.name
            report["example_media"] = _example_media(data)
    report["totals"] = _totals(report["datasets"])
    return report


def _example_media(data: TokenizedDataset) -> dict[str, list[str]]:
    """The first sample's media files (absolute paths) by column, for a preview of what it shows."""
    if len(data) == 0:
        return {}
    found = {k: json.loads(str(data.dense[k][0])) for k in ("images", "videos", "audios") if k in data.dense}
    return {k: v for k, v in found.items() if v}


def _entry(cfg: Config, attr: DatasetAttr, tokenizer: Any, template: Any) -> tuple[dict, TokenizedDataset]:
    """One dataset encoded as training encodes it (cut to cutoff_len); lengths from the whole records."""
    opts = encode_options(cfg)
    data, stats = load_one(cfg, attr, tokenizer, template, opts)
    full = data  # nothing was cut: these are the real lengths
    if stats.truncated:  # encode again without cutoff_len to see how long the records are
        full, _ = encode_records(
            read_limited(attr, cfg.data.max_samples),
            attr,
            tokenizer,
            template,
            dataclasses.replace(opts, cutoff_len=WHOLE_TEXT, bound_tokens=opts.cutoff_len),
            cfg.data.preprocessing_num_workers or 1,
            cfg.data.preprocessing_batch_size,
        )
    entry = stats.to_dict()
    entry.update(trainable_tokens=data.trainable_tokens(), lengths=length_stats(full))
    if opts.media is not None and "images" in data.dense:  # a vision model: images and their tokens
        entry["media"] = media_stats([str(v) for v in data.dense["images"]], opts.media)
    for key in ("videos", "audios") if opts.media is not None else ():  # ... and its videos / audio
        if getattr(opts.media, key[:-1]) is not None and key in data.dense:
            entry[key] = av_stats(key, [str(v) for v in data.dense[key]], data, tokenizer)
    return entry, data


def _split_entry(
    cfg: Config, attr: DatasetAttr, tokenizer: Any, template: Any
) -> tuple[dict, TokenizedDataset]:
    """One pt dataset as packed pt training sees it: each text encoded whole, then cut into consecutive
    pieces of at most cutoff_len tokens (every token kept and trained, nothing truncated)."""
    opts = dataclasses.replace(encode_options(cfg), cutoff_len=WHOLE_TEXT)
    data, stats = load_one(cfg, attr, tokenizer, template, opts)
    lengths = data.lengths()
    block = cfg.data.cutoff_len
    entry = stats.to_dict()
    entry.update(
        truncated=0,
        split_texts=int((lengths > block).sum()),
        pieces=int((-(-lengths // block)).sum()),
        trainable_tokens=data.trainable_tokens(),
        lengths=length_stats(data),
    )
    return entry, data


def _totals(datasets: list[dict]) -> dict:
    dropped: Counter = Counter()
    for d in datasets:
        dropped.update(d["dropped"])
    totals = {
        "records": sum(d["records"] for d in datasets),
        "kept": sum(d["kept"] for d in datasets),
        "dropped": dict(dropped),
        "truncated": sum(d["truncated"] for d in datasets),
        "fields_cut": sum(d["fields_cut"] for d in datasets),
        "trainable_tokens": sum(d["trainable_tokens"] for d in datasets),
        "problems": sum(len(d["problems"]) for d in datasets),
    }
    if datasets and "pieces" in datasets[0]:
        totals.update(
            split_texts=sum(d["split_texts"] for d in datasets), pieces=sum(d["pieces"] for d in datasets)
        )
    return totals


# ---- text rendering ----------------------------------------------------------------------------
TRAINED_TTY, MASKED_TTY, RESET = "\033[1;32m", "\033[2m", "\033[0m"


def _visible(text: str) -> str:
    """Control characters shown escaped (`\\x1b`): printed raw they vanish or drive the terminal."""
    return CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def render_example(segments: list[dict], color: bool) -> str:
    out = []
    for seg in ({**s, "text": _visible(s["text"])} for s in segments):
        if seg["trained"]:
            out.append(f"{TRAINED_TTY}{seg['text']}{RESET}" if color else f"«{seg['text']}»")
        else:
            out.append(f"{MASKED_TTY}{seg['text']}{RESET}" if color else seg["text"])
    return "".join(out)


def _pieces(counts: dict) -> str:
    return f"{counts['split_texts']} split ({counts['kept']} texts -> {counts['pieces']} pieces)"


def format_report(report: dict, color: bool = False) -> str:
    head = f"stage {report['stage']}, template {report['template']}, cutoff_len {report['cutoff_len']}"
    if report.get("pt_split"):
        head += " (texts longer than cutoff_len are split into cutoff_len pieces, not truncated)"
    lines = [head, ""]
    for d in report["datasets"]:
        dropped = sum(d["dropped"].values())
        lines.append(
            f"{d['name']} ({d['split']}): {d['records']} records, {d['kept']} kept, {dropped} dropped"
            + (f" ({format_dropped(DatasetStats.from_dict(d))})" if dropped else "")
            + f", {d['truncated']} truncated"
            + format_fields_cut(DatasetStats.from_dict(d))
            + (f", {_pieces(d)}" if "pieces" in d else "")
            + f", {d['trainable_tokens']} trainable tokens"
        )
        for part in ("prompt", "response", "total"):
            p = d["lengths"][part]
            lines.append(
                f"    {part + ' tokens':<16} p50 {p['p50']:>6}  p95 {p['p95']:>6}  max {p['max']:>6}"
            )
        if "media" in d:
            lines.append(format_media(d["media"]))
        if d["truncated"]:
            lines.append(
                f"    warning: {truncation_warning(DatasetStats.from_dict(d), report['cutoff_len'])}"
            )
        if d.get("placeholders"):
            lines.append(f"    warning: {placeholder_warning(DatasetStats.from_dict(d))}")
        if d.get("control_records"):
            lines.append(f"    warning: {control_warning(DatasetStats.from_dict(d))}")
        lines.extend(format_av(key, d[key]) for key in ("videos", "audios") if key in d)
        for p in d["problems"][:MAX_PRINTED_PROBLEMS]:
            lines.append(f"    problem: {format_problem(p)}")
        if len(d["problems"]) > MAX_PRINTED_PROBLEMS:
            lines.append(f"    ... and {len(d['problems']) - MAX_PRINTED_PROBLEMS} more in data_report.json")
    t = report["totals"]
    lines += [
        "",
        f"total: {t['records']} records, {t['kept']} kept, {sum(t['dropped'].values())} dropped, "
        f"{t['truncated']} truncated, "
        + (f"{t['fields_cut']} fields cut before tokenizing, " if t["fields_cut"] else "")
        + (f"{_pieces(t)}, " if "pieces" in t else "")
        + f"{t['trainable_tokens']} trainable tokens, {t['problems']} problems",
    ]
    if report["example"]:
        legend = "trained tokens in bold green, masked ones dimmed" if color else "trained tokens inside « »"
        lines += ["", f"training example from {report['example_dataset']} ({legend}):", ""]
        lines.append(render_example(report["example"], color))
    return "\n".join(lines)
