"""What changed between the run a checkpoint recorded and this one, and which changes a resume may
take (reliability/output_dir.check_same_run refuses the others): the logging/saving/eval cadence,
reporting, worker counts and timeouts change freely; max_steps / num_train_epochs may only be raised."""

from __future__ import annotations

import json
from typing import Any

SAFE_TO_CHANGE = frozenset(
    """logging_steps save_strategy save_steps save_total_limit save_only_model eval_strategy eval_steps
    per_device_eval_batch_size do_eval report_to logging_dir disable_tqdm plot_loss print_param_status
    include_effective_tokens_per_second output_dir overwrite_output_dir resume_from_checkpoint dataset_dir
    tokenized_path cache_dir export_dir export_size export_device export_overwrite hf_hub_token
    dataloader_num_workers ddp_timeout overwrite_cache preprocessing_num_workers preprocessing_batch_size
    gradient_checkpointing disable_gradient_checkpointing use_reentrant_gc use_unsloth_gc on_nonfinite
    nonfinite_skip_budget project use_swanlab swanlab_project swanlab_workspace swanlab_run_name swanlab_mode
    swanlab_api_key swanlab_logdir ray_num_workers ray_init_kwargs master_addr master_port""".split()
)
SAFE_TO_RAISE = frozenset({"max_steps", "num_train_epochs"})
SAFE_DECISIONS = frozenset(
    {"world_size", "checkpointing", "checkpoint_offload", "allocator", "data_workers", "kept_out"}
)
ABSENT = "(absent)"


def _short(value: Any, width: int = 48) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= width else text[: width - 3] + "..."


def _default(name: str) -> Any:
    from lmstack.config.schema import SECTIONS, field_owner

    section = field_owner().get(name)
    field = SECTIONS[section].model_fields[name] if section else None
    return json.loads(json.dumps(field.default, default=str)) if field is not None else ABSENT


def _safe(section: str, name: str, old: Any, new: Any, old_run: dict, new_run: dict) -> bool:
    if section == "decisions":
        return name in SAFE_DECISIONS or ABSENT in (old, new)  # a decision another lmstack did not take
    if section != "config":
        return False
    if name in SAFE_TO_CHANGE or new == ABSENT:
        return True
    if old == ABSENT:
        return new == _default(name)  # a field newer than the checkpoint, at its default
    by_steps = all((run["config"].get("max_steps") or 0) > 0 for run in (old_run, new_run))
    if name == "num_train_epochs" and by_steps:
        return True  # max_steps decides the length
    numbers = isinstance(old, int | float) and isinstance(new, int | float)
    return name in SAFE_TO_RAISE and numbers and new > old and (name != "max_steps" or old > 0)


def run_changes(old: dict, new: dict) -> tuple[list[str], list[str]]:
    """(changes that are not safe to resume with, safe ones), each as `name: old -> new`."""
    unsafe, safe = [], []
    labels = {"config": "", "decisions": "run plan ", "data": "data file ", "inputs": ""}
    for section, label in labels.items():
        a, b = old.get(section), new.get(section)
        if a is None or b is None:
            continue  # not recorded (the decisions of a trainer that only gets the config)
        for name in sorted(set(a) | set(b)):
            before, after = a.get(name, ABSENT), b.get(name, ABSENT)
            if before == after:
                continue
            line = f"{label}{name}: {_short(before)} -> {_short(after)}"
            if _safe(section, name, before, after, old, new):
                safe.append(line)
            else:
                unsafe.append(line + (" (only a raise resumes)" if name in SAFE_TO_RAISE else ""))
    return unsafe, safe
