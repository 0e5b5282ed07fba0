"""Row lengths for runs whose rows are not packed: read from the data, not assumed to be `cutoff_len`.

An unpacked batch is padded to its longest row (train/common.PadCollator), so its tokens are
micro_batch x (the longest of its rows). The sampler draws rows in random order: over an epoch every row
is drawn, so the batch that holds the longest row of the data is formed -- the peak is micro_batch x that
length. A run shorter than an epoch (max_steps) draws `seen` rows; the planner then takes the length that
the longest of `seen` random rows stays below with probability SAFE_LEVEL (the quantile
SAFE_LEVEL ** (1 / seen) of the rows' lengths), never more than the longest row.

Where the order the Trainer draws rows in can be replayed, it is, and the bound is exact: the Trainer's
sampler is accelerate's SeedableRandomSampler seeded with `data_seed` (train/common passes the run's
seed), whose first epoch is torch.randperm(rows) (`torch_randperm` reproduces it without torch), or the
rows in order under `disable_shuffling`; num_samples and the val_size split are replayed with the data
layer's own index functions. A run of steps x batch rows (sft, pt unpacked) then pads to the
longest of exactly those rows; a pairwise run (dpo and its reference-free losses, rm) pads the chosen and
rejected sides of its steps x batch pairs to the longest prompt + answer among them. Other mixes and
stages (interleaving; kto, whose KL batches pair each row with another row's answer; the RL stages'
repeat sampler) keep the SAFE_LEVEL bound.

The lengths come from the tokenized cache (data/cache.py) when an entry for this data and these encode
options exists (found without loading the tokenizer; entries that differ only in tokenizer or template
count with the longest of them), else from one pass of the real data pipeline, which stores the cache
entry `lmstack train` then reuses. Pairwise rows (dpo, rm) count the longer of chosen and rejected;
prompt stages (grpo, rloo, ppo) the prompt.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from lmstack.plan.runplan import RunPlan

logger = logging.getLogger(__name__)
SAFE_LEVEL = 0.95
PAIRED_KEYS = ("chosen_input_ids", "rejected_input_ids")


@dataclass(frozen=True)
class DataLengths:
    longest: int  # the longest row of the training data (tokens; pairwise: the longer side)
    bound: int  # the row length the planner uses (longest, or the SAFE_LEVEL bound of a short run)
    rows: int  # rows in the training data
    seen: int  # rows the run draws (max_steps), capped at `rows`
    source: str  # where the lengths were read
    exact: bool = False  # bound is the longest of the very rows the sampler draws (its order replayed)

    def describe(self) -> str:
        if self.exact and self.seen < self.rows:
            how = f"the longest of the {self.seen} rows the sampler draws in max_steps (of {self.rows})"
        elif self.bound == self.longest:
            how = f"the longest of {self.rows} rows"
        else:
            how = f"{SAFE_LEVEL:.0%} bound on the longest of the {self.seen} rows max_steps draws (of {self.rows})"
        return f"{how}; from {self.source}"


def row_lengths(folder: Path) -> np.ndarray | None:
    """Per-row lengths of one cache entry, from its offsets alone (the token values are not read)."""

    def lengths(key: str) -> np.ndarray | None:
        path = folder / f"ragged.{key}.offsets.npy"
        return np.diff(np.load(path, allow_pickle=False)) if path.is_file() else None

    chosen, rejected = (lengths(k) for k in PAIRED_KEYS)
    if chosen is not None and rejected is not None:
        return np.maximum(chosen, rejected)
    return lengths("input_ids")


def _normalised(value: object) -> object:
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def cached_lengths(cfg, attr) -> tuple[np.ndarray, str] | None:
    """The lengths of the complete cache entries made from this data with these encode options."""
    import lmstack
    from lmstack.data import cache
    from lmstack.data.stats import encode_options

    root = cache.cache_root()
    if not root.is_dir():
        return None
    want = _normalised(
        {
            "data": cache.data_digest(attr),
            "entry": {k: v for k, v in asdict(attr).items() if k not in ("source", "num_samples")},
            "options": asdict(encode_options(cfg)),
            "max_samples": cfg.data.max_samples,
            "lmstack": lmstack.__version__,
            "code": cache._code_digest(),
        }
    )
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in attr.name)
    found: list[np.ndarray] = []
    for key_file in root.glob(f"{safe}-*/key.json"):
        if not (key_file.parent / "COMPLETE").is_file():
            continue
        try:
            parts = json.loads(key_file.read_text())
            if all(parts.get(k) == v for k, v in want.items()):
                got = row_lengths(key_file.parent)
                if got is not None:
                    found.append(got)
        except (OSError, ValueError):
            continue
    if not found:
        return None
    longest = max(found, key=lambda a: int(a.max(initial=0)))
    return longest, f"the tokenized cache ({len(found)} entr{'y' if len(found) == 1 else 'ies'})"


def tokenized_lengths(cfg, attr) -> tuple[np.ndarray, str]:
    """One pass of the real pipeline (tokenizer + template + encoder); it stores the cache entry."""
    from lmstack.data.pipeline import load_one
    from lmstack.models.load import load_tokenizer
    from lmstack.templates import get_template

    tokenizer = load_tokenizer(cfg)
    template = get_template(
        cfg.data.template,
        tokenizer,
        thinking_style=cfg.data.thinking_style,
        escape_content=cfg.data.escape_special_tokens_in_content,
    )
    template.fix_tokenizer(tokenizer)
    logger.info("plan: tokenizing dataset %s for its row lengths (cached for training)", attr.name)
    data, _ = load_one(cfg, attr, tokenizer, template)
    if all(k in data.keys() for k in PAIRED_KEYS):
        return np.maximum(*(data.lengths(k) for k in PAIRED_KEYS)), "a tokenizer pass (now cached)"
    return data.lengths("input_ids"), "a tokenizer pass (now cached)"


def seen_rows(plan: RunPlan, rows: int) -> int:
    """Distinct rows a max_steps run draws. grpo/rloo (TRL's RepeatSampler): each prompt is drawn once
    and answered num_generations times, and per_device_train_batch_size counts answers, so a step
    draws micro_batch / num_generations prompts."""
    from lmstack.config.stages import STAGE_SPECS

    cfg = plan.cfg
    t = cfg.training
    if t.max_steps and t.max_steps > 0:
        drawn = t.max_steps * plan.micro_batch * t.gradient_accumulation_steps * plan.world_size
        if STAGE_SPECS[cfg.finetuning.stage].generates and cfg.finetuning.stage != "ppo":
            drawn = -(-drawn // max(cfg.finetuning.num_generations, 1))
        return min(rows, drawn)
    return rows


# torch's CPU randperm draws 64-bit numbers from this size on (aten/src/ATen/native/TensorFactories.cpp)
RANDPERM_32BIT_BELOW = (1 << 32) // 20
# the Trainer's own sampler; each stage's collation held equal to a real run by a test (test_lengths.py)
REPLAYED_STAGES = ("sft", "pt", "dpo", "rm")


def torch_randperm_head(n: int, seed: int, head: int) -> np.ndarray | None:
    """The first `head` entries of torch.randperm(n) from a CPU generator seeded with `seed`, without
    torch: a forward Fisher-Yates shuffle whose i-th swap partner is i + (mt19937 draw i) % (n - i),
    the draws a 32-bit MT19937 seeded like torch's (the low 32 bits of the seed) gives; position i is
    final after swap i, so only `head` swaps run. None where torch draws 64-bit numbers instead."""
    if n >= RANDPERM_32BIT_BELOW or n <= 0:
        return None
    head = min(head, n)
    draws = np.random.RandomState(seed & 0xFFFFFFFF).randint(
        0, 1 << 32, size=min(head, n - 1), dtype=np.uint32
    )
    moved: dict[int, int] = {}
    out = np.empty(head, dtype=np.int64)
    for i in range(head):
        if i < n - 1:
            j = i + int(draws[i]) % (n - i)
            out[i] = moved.get(j, j)
            moved[j] = moved.get(i, i)
        else:
            out[i] = moved.get(i, i)
    return out


def replayed_train_lengths(plan: RunPlan, attrs: list, arrays: list[np.ndarray]) -> np.ndarray | None:
    """The training rows' lengths in the order the data layer leaves them (num_samples, concat, the
    val_size split replayed), or None where that order is not replayed here."""
    from lmstack.data.pipeline import num_samples_order, validation_order

    d, seed = plan.cfg.data, plan.cfg.training.seed
    if len(arrays) > 1 and d.mix_strategy != "concat":
        return None
    parts = [a if attr.num_samples is None or not len(a) else a[num_samples_order(len(a), attr.num_samples, seed)]
             for attr, a in zip(attrs, arrays)]  # fmt: skip
    whole = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    if d.val_size > 0 and len(whole):
        whole = whole[validation_order(len(whole), d.val_size, seed)[0]]
    return whole


def drawn_bound(plan: RunPlan, lengths: np.ndarray, seen: int) -> int | None:
    """The longest of the `seen` rows the run's sampler draws first (its first epoch), or None where the
    sampler's order is not replayed."""
    cfg = plan.cfg
    if cfg.finetuning.stage not in REPLAYED_STAGES or seen >= len(lengths):
        return None
    if cfg.finetuning.disable_shuffling:
        return int(lengths[:seen].max())
    order = torch_randperm_head(len(lengths), cfg.training.seed, seen)
    return None if order is None else int(lengths[order].max())


def bound(lengths: np.ndarray, seen: int) -> int:
    if seen >= len(lengths):
        return int(lengths.max())
    level = SAFE_LEVEL ** (1.0 / max(seen, 1))
    return int(np.quantile(lengths, level, method="higher"))


def data_lengths(plan: RunPlan, tokenize: bool = True) -> DataLengths | None:
    """The training data's row lengths for an unpacked run; None for packed rows or without data (or
    when the data cannot be read: the planner then keeps cutoff_len, the worst case)."""
    from lmstack.config.errors import LmstackError
    from lmstack.data.registry import get_dataset_attrs

    cfg = plan.cfg
    if plan.packing or not cfg.data.dataset or cfg.data.streaming:
        return None
    try:
        attrs = get_dataset_attrs(cfg.data.dataset, cfg.data.dataset_dir)
        arrays, sources = [], []
        for attr in attrs:
            got = cached_lengths(cfg, attr)
            if got is None and tokenize:
                try:
                    got = tokenized_lengths(cfg, attr)
                except Exception as err:  # a tokenizer that will not load here: the worst case, said once
                    logger.warning("plan: could not tokenize %s for its row lengths (%s); using cutoff_len",
                                   attr.name, err)  # fmt: skip
                    return None
            if got is None:
                return None
            arrays.append(got[0])
            sources.append(got[1])
    except (LmstackError, OSError, ValueError) as err:
        logger.info("plan: row lengths not read from the data (%s); using cutoff_len", err)
        return None
    source = ", ".join(dict.fromkeys(sources))
    train = replayed_train_lengths(plan, attrs, arrays)
    if train is not None and len(train):
        seen = seen_rows(plan, len(train))
        exact = drawn_bound(plan, train, seen)
        if exact is not None:
            return DataLengths(int(train.max()), exact, len(train), seen, source, exact=True)
    lengths = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
    if not len(lengths):
        return None
    seen = seen_rows(plan, len(lengths))
    longest = int(lengths.max())
    return DataLengths(longest, min(bound(lengths, seen), longest), len(lengths), seen, source)
