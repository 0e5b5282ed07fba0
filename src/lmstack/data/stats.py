"""What the pipeline and the streaming reader share: per-dataset counts of every record kept, cut or
dropped (with the reason), how they are logged and reported, and the stage's encoding options."""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from lmstack.config.errors import DataError
from lmstack.config.schema import Config
from lmstack.config.stages import stage_spec
from lmstack.data.encode import EncodeOptions
from lmstack.data.mm import media_spec
from lmstack.data.registry import DatasetAttr
from lmstack.data.tokenized import TokenizedDataset

logger = logging.getLogger(__name__)
MAX_LOGGED_PROBLEMS = 20


@dataclass
class DatasetStats:
    name: str
    records: int = 0
    kept: int = 0
    truncated: int = 0
    dropped: Counter = field(default_factory=Counter)  # kind -> count
    problems: list[dict] = field(default_factory=list)  # file, position, field, kind, reason
    fields_cut: int = 0  # text fields cut to field_chars characters before tokenizing
    field_chars: int = 0
    placeholders: Counter = field(default_factory=Counter)  # "{{name}}" -> kept records holding it
    control: list[dict] = field(default_factory=list)  # kept records with control characters (first ones)
    control_records: int = 0

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "records": self.records,
            "kept": self.kept,
            "truncated": self.truncated,
            "dropped": dict(self.dropped),
            "problems": self.problems,
            "fields_cut": self.fields_cut,
            "field_chars": self.field_chars,
            "placeholders": dict(self.placeholders),
            "control": self.control,
            "control_records": self.control_records,
        }

    @classmethod
    def from_dict(cls, d: dict) -> DatasetStats:
        return cls(
            d["name"],
            d["records"],
            d["kept"],
            d["truncated"],
            Counter(d["dropped"]),
            d["problems"],
            d.get("fields_cut", 0),  # absent from the reports written before the bound existed
            d.get("field_chars", 0),
            Counter(d.get("placeholders", {})),
            d.get("control", []),
            d.get("control_records", 0),
        )


@dataclass
class DataBundle:
    train: TokenizedDataset | None
    eval: TokenizedDataset | None
    stats: list[DatasetStats]


def format_problem(p: dict) -> str:
    """`file line 3, field conversations[1].from: unknown role: 'bot'; known: ...` (check and train)."""
    where = f"{p['file']} {p['position']}" + (f", field {p['field']}" if p.get("field") else "")
    return f"{where}: {p['reason']}"


def strict_refusal(all_stats: list[DatasetStats]) -> DataError | None:
    """`strict: true` (`lmstack train --strict`): any dropped record refuses the run, every one listed
    (as `lmstack check --strict` fails on any problem); None when nothing was dropped."""
    problems = [p for s in all_stats for p in s.problems]
    if not problems:
        return None
    shown = problems[:MAX_LOGGED_PROBLEMS]
    more = (
        f"\n  ... and {len(problems) - len(shown)} more (all listed by `lmstack check`)"
        if len(problems) > len(shown)
        else ""
    )
    return DataError(
        f"strict: {len(problems)} record(s) would be dropped from the data; fix them (or leave out --strict / "
        "strict: true to train on the rest):\n" + "\n".join(f"  {format_problem(p)}" for p in shown) + more
    )


def format_dropped(stats: DatasetStats) -> str:
    return ", ".join(f"{n} x {kind}" for kind, n in stats.dropped.most_common()) or "none"


def format_fields_cut(stats: DatasetStats) -> str:
    """`, 3 fields cut to 4096 characters before tokenizing` ('' when none was)."""
    if not stats.fields_cut:
        return ""
    return f", {stats.fields_cut} fields cut to {stats.field_chars} characters before tokenizing"


PLACEHOLDER = re.compile(r"\{\{\s*[A-Za-z_][A-Za-z0-9_]*\s*\}\}")


def placeholders_in(record: Any) -> set[str]:
    """The `{{name}}`-style placeholders in a record's strings (LF's identity.json ships `{{name}}`
    and `{{author}}` for the user to replace before training)."""
    if isinstance(record, str):
        return set(PLACEHOLDER.findall(record)) if "{{" in record else set()
    values = record.values() if isinstance(record, dict) else record if isinstance(record, list) else ()
    return set().union(*(placeholders_in(v) for v in values))


def placeholder_warning(stats: DatasetStats) -> str:
    ranked = sorted(
        stats.placeholders.items(), key=lambda kv: (-kv[1], kv[0])
    )  # ties by name: one order every run
    found = ", ".join(f"{name} ({n})" for name, n in ranked)
    return (
        f"dataset {stats.name}: records hold unfilled placeholders: {found} records; the model would "
        "learn the braces as written. Replace them before training (LLaMA-Factory's identity.json "
        "ships {{name}} and {{author}}: sed -i 's/{{name}}/MyModel/g; s/{{author}}/MyTeam/g' FILE)"
    )


WHOLE_TEXT = 1 << 30  # cutoff_len of a whole-record encode (`lmstack check`, and pt texts on packed rows)


# C0 controls but tab/newline/carriage return, and DEL: invisible in a terminal (ESC even rewrites it)
CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
MAX_CONTROL_SHOWN = 5


def control_chars_in(record: Any) -> set[str]:
    """The control characters (as U+XXXX) in a record's strings: trained as written, never meant."""
    if isinstance(record, str):
        return {f"U+{ord(c):04X}" for c in CONTROL.findall(record)}
    values = record.values() if isinstance(record, dict) else record if isinstance(record, list) else ()
    return set().union(*(control_chars_in(v) for v in values))


def control_warning(stats: DatasetStats) -> str:
    where = "; ".join(f"{c['file']} {c['position']} ({', '.join(c['chars'])})" for c in stats.control)
    more = (
        f" and {stats.control_records - len(stats.control)} more"
        if stats.control_records > len(stats.control)
        else ""
    )
    return (
        f"dataset {stats.name}: {stats.control_records} kept records hold control characters, which are "
        f"tokenized and trained as written: {where}{more}; remove them from the data if not intended"
    )


def truncation_warning(stats: DatasetStats, cutoff_len: int) -> str:
    """A warning, not a note: rows cut to cutoff_len lose the answer's end (LF truncates silently,
    and a small cutoff_len can leave one trained token a row)."""
    return (
        f"dataset {stats.name}: {stats.truncated} of {stats.kept} kept records are longer than "
        f"cutoff_len={cutoff_len} and were truncated (their tokens past it are not trained); raise "
        "cutoff_len if that is not intended (`lmstack check` shows the record lengths)"
    )


def log_stats(stats: DatasetStats, cutoff_len: int) -> None:
    # texts encoded whole (pt on packed rows): nothing is cut here, the cutoff_len pieces come later
    cut = (
        "texts kept whole (split into cutoff_len pieces next)"
        if cutoff_len >= WHOLE_TEXT
        else f"{stats.truncated} truncated to cutoff_len={cutoff_len}"
    )
    logger.info(
        "dataset %s: %d records, %d kept, %d dropped (%s), %s%s",
        stats.name,
        stats.records,
        stats.kept,
        sum(stats.dropped.values()),
        format_dropped(stats),
        cut,
        format_fields_cut(stats),
    )
    if stats.truncated:
        logger.warning("%s", truncation_warning(stats, cutoff_len))
    if stats.placeholders:
        logger.warning("%s", placeholder_warning(stats))
    if stats.control_records:
        logger.warning("%s", control_warning(stats))
    for p in stats.problems[:MAX_LOGGED_PROBLEMS]:
        logger.warning("  %s", format_problem(p))
    if len(stats.problems) > MAX_LOGGED_PROBLEMS:
        logger.warning(
            "  ... and %d more (all listed by `lmstack check`)", len(stats.problems) - MAX_LOGGED_PROBLEMS
        )


def encode_options(cfg: Config) -> EncodeOptions:
    return EncodeOptions(
        stage=cfg.finetuning.stage,
        cutoff_len=cfg.data.cutoff_len,
        train_on_prompt=cfg.data.train_on_prompt,
        mask_history=cfg.data.mask_history,
        default_system=cfg.data.default_system,
        enable_thinking=cfg.data.enable_thinking,
        preserve_thinking=cfg.data.preserve_thinking,
        media=media_spec(cfg),
    )


def check_ranking(attr: DatasetAttr, stage: str) -> None:
    pairwise = stage_spec(stage).data == "pairwise"
    if attr.ranking and not pairwise:
        raise DataError(
            f"dataset {attr.name}: a ranking (chosen/rejected) dataset cannot be used with stage "
            f"{stage}; use stage rm or dpo, or pick an instruction dataset"
        )
    if pairwise and not attr.ranking:
        raise DataError(
            f'dataset {attr.name}: stage {stage} needs a ranking dataset ("ranking": true with '
            "chosen/rejected columns in dataset_info.json)"
        )


def no_valid_samples(stats: list[DatasetStats]) -> DataError:
    lines = ["no trainable record in the training data. Breakdown (kept / dropped by reason):"]
    for s in stats:
        lines.append(f"  {s.name}: {s.records} records, {s.kept} kept, dropped: {format_dropped(s)}")
        for p in s.problems[:5]:
            lines.append(f"    {format_problem(p)}")
        if len(s.problems) > 5:
            lines.append(f"    ... and {len(s.problems) - 5} more")
    lines.append(
        "Fix the records or the `columns`/`tags` mapping in dataset_info.json; "
        "`lmstack check <config>` lists every problem."
    )
    return DataError("\n".join(lines))
