"""output_dir: what a run may find there, what it deletes, and whether a resume may go on.

Where output_dir may be (never on a model, an adapter or the data; writable): path_guards.py.

`prepare(plan)` (every stage's first step) returns the checkpoint to resume from, or None:
- no resume_from_checkpoint: output_dir must be empty (`lmstack check`'s data_report.json aside)
  unless overwrite_output_dir, which deletes only what lmstack wrote: checkpoint-N folders with an
  lmstack manifest, the folders of killed saves, the OWN_OUTPUTS files and the files an earlier final
  save recorded writing (outputs_record.py: the adapter or model, tokenizer files, README.md, ...), still
  as written; the log lists what was removed. Anything else (a user file, checkpoint-best-by-hand, a
  checkpoint-N without a manifest, a recorded file changed since) is left there and named in the log.
- `auto`: the newest checkpoint whose manifest verifies. Without one, the run starts fresh only when
  output_dir holds nothing but lmstack's own run files (a run killed before its first save); another
  run's files (adapter_model.safetensors, README.md, ...) are refused as without `auto`, unless
  overwrite_output_dir.
- a path: it must be a complete checkpoint.

A resume compares the resolved run stored in the checkpoint's manifest (manifest.run_identity: the
config with secrets redacted, the run plan's decisions, the sha256 of every data file) with this
run's, lists every change and refuses (ConfigError, exit 2) unless each one is safe to resume with:
  - max_steps, num_train_epochs: raised (a longer run; the schedule follows the new length);
    num_train_epochs freely while max_steps > 0 decides the length;
  - cadence and reporting: logging_steps, save_strategy, save_steps, save_total_limit, save_only_model,
    eval_strategy, eval_steps, per_device_eval_batch_size, do_eval, report_to, logging_dir,
    disable_tqdm, plot_loss, print_param_status, include_effective_tokens_per_second, the trackers'
    project / use_swanlab / swanlab_* settings;
  - where things are: output_dir, overwrite_output_dir, resume_from_checkpoint, dataset_dir (the
    data is compared by content), tokenized_path (checked by its own key), cache_dir, export_dir,
    export_size, export_device, export_overwrite, hf_hub_token;
  - speed, not results: dataloader_num_workers, ddp_timeout, overwrite_cache,
    preprocessing_num_workers, preprocessing_batch_size, gradient checkpointing
    (gradient_checkpointing, disable_gradient_checkpointing, use_reentrant_gc, use_unsloth_gc, the
    plan's checkpointing and checkpoint_offload), the process count and its launcher (the plan's
    world_size, the Ray fields; trainer.py warns that the run will not match an uninterrupted one);
  - on_nonfinite, nonfinite_skip_budget (a larger budget continues a run that used it up).
Anything else (dataset, a data file's content, learning_rate, the model, LoRA settings, batch
sizes, seed, precision, ...) changes what the checkpoint's steps would have trained. A checkpoint
saved without this record (an older lmstack) resumes with a warning.

A run that already reached its last step resumes to "nothing to do" (`finished_run`, before anything
loads): the log says so, the metrics saved in all_results.json are returned, exit 0, output_dir is
not written. When the last checkpoint is complete but the final outputs are not (killed while they
were written), a reliable trainer writes them from that checkpoint without training a step
(trainer.py); a stage without it resumes from the newest earlier checkpoint.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from lmstack.config.errors import ConfigError
from lmstack.config.schema import Config
from lmstack.plan.runplan import RunPlan
from lmstack.reliability import final_outputs
from lmstack.reliability.checkpoint import (
    check_trainer_state,
    checkpoint_step,
    clean_staging,
    delete_checkpoint,
    is_staging,
    list_checkpoints,
    read_manifest,
    refuse_linked,
    select_resume_checkpoint,
    verify_checkpoint,
)
from lmstack.reliability.manifest import identity_hash, run_identity
from lmstack.reliability.outputs_record import OUTPUTS_RECORD, recorded_outputs
from lmstack.reliability.run_changes import run_changes

logger = logging.getLogger(__name__)
CONFIG_FILE = "lmstack_config.yaml"
LOG_FILE = "trainer_log.jsonl"
REPORT_FILE = "data_report.json"  # `lmstack check`
RESULTS_FILE = "all_results.json"
STATE_FILE = "trainer_state.json"
OWN_OUTPUTS = (
    "trainer_log.jsonl",
    "trainer_state.json",
    "train_results.json",
    "eval_results.json",
    "all_results.json",
    "training_loss.png",
    "training_eval_loss.png",
    "training_eval_accuracy.png",  # compute_accuracy (sft, pt); rm
    "run_manifest.json",
    "value_head.safetensors",  # rm / ppo
    "training_rewards_accuracies.png",  # dpo
    "training_rewards_chosen.png",  # kto
    "generated_predictions.jsonl",  # sft do_predict
    "predict_results.json",
    final_outputs.FINAL,
    final_outputs.PENDING,
    CONFIG_FILE,
    OUTPUTS_RECORD,
)


# ---- what is in output_dir ----------------------------------------------------------------------
def _lmstack_checkpoint(path: Path) -> bool:
    """checkpoint-N with an lmstack manifest (complete or damaged): lmstack wrote it."""
    return (
        path.is_dir()
        and not path.is_symlink()
        and checkpoint_step(path) is not None
        and read_manifest(path) is not None
    )


def _own_run_file(path: Path) -> bool:
    """What an lmstack run leaves before its first complete checkpoint (killed early, or damaged)."""
    if path.is_dir():
        return is_staging(path) or _lmstack_checkpoint(path)
    return path.name in OWN_OUTPUTS or path.name == REPORT_FILE


def _not_empty(out: Path, found: list[Path], auto: bool) -> ConfigError:
    names = ", ".join(p.name for p in found[:8]) + (f", ... ({len(found)} entries)" if len(found) > 8 else "")
    why = (
        "; resume_from_checkpoint: auto found no complete lmstack checkpoint to continue from, and these "
        "are not files of an lmstack run"
        if auto
        else ""
    )
    return ConfigError(
        f"output_dir: {out} already exists and is not empty; set overwrite_output_dir: true to replace it, "
        f"or resume_from_checkpoint: auto to continue the run (found: {names}){why}"
    )


def _delete_own(out: Path) -> None:
    """overwrite_output_dir: delete what lmstack wrote (its manifests and the record of its final save
    know it: outputs_record.py), say what was removed, and name what is left."""
    kept, removed, recorded = [], [], recorded_outputs(out)
    for path in sorted(out.iterdir()):
        if is_staging(path):
            shutil.rmtree(path, ignore_errors=True)
        elif _lmstack_checkpoint(path):
            delete_checkpoint(path)
            removed.append(path.name)
        elif path.is_file() and (path.name in OWN_OUTPUTS or path.name in recorded):
            path.unlink(missing_ok=True)
            removed.append(path.name)
        elif path.name != REPORT_FILE:
            kept.append(path.name)
    if removed:
        logger.info(
            "overwrite_output_dir: removed from %s what an earlier lmstack run wrote there: %s",
            out,
            ", ".join(removed),
        )
    if kept:
        logger.warning(
            "overwrite_output_dir: left in %s what no lmstack manifest or record lists: %s (the final save replaces "
            "files of the same name)",
            out,
            ", ".join(kept),
        )


def _start_fresh(cfg: Config, is_main: bool, auto: bool) -> None:
    out = Path(cfg.training.output_dir)
    if not out.is_dir():
        return
    found = [p for p in sorted(out.iterdir()) if p.name != REPORT_FILE and not (auto and _own_run_file(p))]
    if found and not cfg.training.overwrite_output_dir:
        raise _not_empty(out, found, auto)
    if is_main and cfg.training.overwrite_output_dir:
        _delete_own(out)


# ---- resume: which checkpoint, from the same run? -----------------------------------------------
def _select(cfg: Config, deep: bool, quiet: bool) -> Path | None:
    resume = cfg.training.resume_from_checkpoint
    if resume == "auto":
        return select_resume_checkpoint(cfg.training.output_dir, deep=deep, quiet=quiet)
    path = Path(resume)
    if not path.is_dir():
        if quiet:
            return None
        raise ConfigError(
            f"resume_from_checkpoint: {resume} is not a directory; give a checkpoint-N folder or `auto`"
        )
    reason = verify_checkpoint(path, deep=deep)
    if reason:
        if quiet:
            return None
        raise ConfigError(
            f"resume_from_checkpoint: {resume} is not a complete checkpoint: {reason}; "
            "give another checkpoint-N folder or `auto` (the newest complete one)"
        )
    return path


def check_same_run(checkpoint: Path, plan: RunPlan, manifest: dict | None = None) -> None:
    """Refuses a resume whose config, plan or data differ from the checkpoint's in an unsafe way."""
    manifest = manifest if manifest is not None else read_manifest(checkpoint) or {}
    stored = manifest.get("run")
    if not isinstance(stored, dict):
        logger.warning(
            "resume: %s does not record the run it was trained with (saved by an older lmstack): a change "
            "of dataset, learning_rate, max_steps or any other setting cannot be detected",
            checkpoint,
        )
        return
    current = run_identity(plan.cfg, plan.decisions())
    if manifest.get("run_hash") == current["run_hash"] or identity_hash(stored) == current["run_hash"]:
        return
    unsafe, safe = run_changes(stored, current["run"])
    if unsafe:
        ft = plan.cfg.finetuning.finetuning_type
        start = "adapter_name_or_path" if ft == "lora" else "model_name_or_path"
        raise ConfigError(
            f"resume_from_checkpoint: {checkpoint} was trained with other settings; changed: "
            + "; ".join(unsafe)
            + (f" (safe: {'; '.join(safe)})" if safe else "")
            + ". A resume continues the same run: restore these settings and files (data, dataset_info.json, "
            "model folders), or train a new run in another "
            f"output_dir starting from its weights ({start}: {checkpoint}). What may change on a resume: "
            "max_steps/num_train_epochs raised, the logging/saving/eval cadence, reporting, worker counts, "
            "timeouts (lmstack.reliability.run_changes)"
        )
    if safe:
        logger.info("resume: changed since %s, safe to resume with: %s", checkpoint, "; ".join(safe))


# ---- a run that reached its last step -----------------------------------------------------------
def _last_step_reached(checkpoint: Path, cfg: Config, manifest: dict) -> bool:
    step = checkpoint_step(checkpoint)
    if step is None:
        step = manifest.get("step")
    if not isinstance(step, int):
        return False
    t = cfg.training
    if t.max_steps > 0:
        return step >= t.max_steps
    old_epochs = ((manifest.get("run") or {}).get("config") or {}).get("num_train_epochs")
    if isinstance(old_epochs, int | float) and t.num_train_epochs > old_epochs:
        return False
    try:
        planned = json.loads((checkpoint / STATE_FILE).read_text()).get("max_steps")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(planned, int) and 0 < planned <= step


def _final_metrics(out: Path, step: int | None) -> dict | None:
    """all_results.json when the final outputs of the run that ended at `step` are all written."""
    state, config, results = out / STATE_FILE, out / CONFIG_FILE, out / RESULTS_FILE
    if final_outputs.incomplete(out):
        return None  # stopped while the final outputs were written (a kill, a full disk)
    try:
        if json.loads(state.read_text()).get("global_step") != step:
            return None  # killed while the final model was written (its trainer_state.json comes next)
        written = state.stat().st_mtime_ns
        if config.stat().st_mtime_ns < written or results.stat().st_mtime_ns < written:
            return None  # killed before the metrics / lmstack_config.yaml (written last) of this end
        metrics = json.loads(results.read_text())
    except (OSError, ValueError, AttributeError):
        return None
    return metrics if isinstance(metrics, dict) else None


def finished_run(plan: RunPlan) -> dict | None:
    """A resume of a run that already reached its last step and wrote its outputs: logs "nothing to
    do" and returns the saved metrics (all_results.json); None otherwise. Reads only; cheap (sizes,
    not sha256: a finished run's outputs are what counts)."""
    cfg = plan.cfg
    if cfg.training.resume_from_checkpoint is None:
        return None
    checkpoint = _select(cfg, deep=False, quiet=True)
    manifest = read_manifest(checkpoint) if checkpoint is not None else None
    if checkpoint is None or manifest is None or not _last_step_reached(checkpoint, cfg, manifest):
        return None
    check_same_run(checkpoint, plan, manifest)  # a changed dataset or lr is refused, not "done"
    out = Path(cfg.training.output_dir)
    metrics = _final_metrics(out, checkpoint_step(checkpoint))
    if metrics is None:
        return None  # the final outputs are incomplete: `prepare` finishes them
    logger.info(
        "resume_from_checkpoint: %s -> %s is the run's last step (max_steps %s): nothing to do; the outputs "
        "in %s are left as they are (raise max_steps to train further)",
        cfg.training.resume_from_checkpoint,
        checkpoint,
        cfg.training.max_steps if cfg.training.max_steps > 0 else "from num_train_epochs",
        out,
    )
    return metrics


def _earlier_checkpoint(cfg: Config, before: int) -> Path | None:
    for folder in list_checkpoints(cfg.training.output_dir):
        if (checkpoint_step(folder) or 0) < before and verify_checkpoint(folder, deep=True) is None:
            return folder
    return None


# ---- every stage's first step -------------------------------------------------------------------
def prepare(plan: RunPlan) -> str | None:
    """The checkpoint to resume from (or None); refuses to mix runs silently (see the module doc)."""
    cfg = plan.cfg
    out = Path(cfg.training.output_dir)
    resume = cfg.training.resume_from_checkpoint
    if plan.is_main:
        clean_staging(out)  # folders of saves killed midway
    if resume is None:
        _start_fresh(cfg, plan.is_main, auto=False)
        return None
    refuse_linked(out)
    checkpoint = _select(cfg, deep=True, quiet=False)  # newest with a valid manifest; skipped ones logged
    if resume == "auto":
        logger.info(
            "resume_from_checkpoint: auto -> %s", checkpoint or "no complete checkpoint found, starting fresh"
        )
    if checkpoint is None:
        _start_fresh(cfg, plan.is_main, auto=True)
        return None
    manifest = read_manifest(checkpoint) or {}
    check_trainer_state(checkpoint)
    check_same_run(checkpoint, plan, manifest)
    if _last_step_reached(checkpoint, cfg, manifest) and not manifest.get("outputs_from_checkpoint"):
        step = checkpoint_step(checkpoint) or 0
        earlier = _earlier_checkpoint(cfg, step) if resume == "auto" else None
        if earlier is None:
            raise ConfigError(
                f"resume_from_checkpoint: {checkpoint} is the run's last step but the final outputs in {out} "
                f"were not all written, and stage {plan.stage.name} cannot write them without training a "
                "step; resume from an earlier checkpoint-N, or set overwrite_output_dir: true to train again"
            )
        logger.warning(
            "resume: %s is the last step, its final outputs are incomplete: from %s", checkpoint, earlier
        )
        check_same_run(earlier, plan)
        return str(earlier)
    return str(checkpoint)
