"""`ReliableMixin`, mixed in before a transformers/TRL Trainer class (each stage declares its own,
e.g. train/lm_trainer.ReliableSFTTrainer; the private hooks it overrides: reliability/seam.py):
- staged, manifest-committed checkpoints (see `checkpoint`), rotation that keeps complete ones;
- SIGTERM/SIGINT: finish the step, all ranks agree on the stop step, save, raise `TrainingStopped`
  (the CLI exits 128 + signal: 143 SIGTERM, 130 SIGINT); a second signal aborts at once;
- `on_nonfinite`: abort naming the step, or skip the optimizer update (params and optimizer state
  unchanged; the scheduler still advances) within `nonfinite_skip_budget`; NaN stays visible in logs;
- refusal, with a clear message, of checkpoint files that are not plain tensors (torch.load is
  weights_only in transformers; a pickle that needs code fails instead of running);
- run_manifest.json written when training starts; every checkpoint's manifest.json records the resolved
  run (manifest.run_identity) so a resume can refuse changed settings (output_dir.py);
- never a step past max_steps: resumed from the last step (the final outputs were not all written),
  it trains nothing and the final outputs are written from that checkpoint.
"""

from __future__ import annotations

import functools
import logging
import pickle
import shutil
import signal
from pathlib import Path
from typing import Any

from lmstack.config.errors import ConfigError, LmstackError
from lmstack.config.schema import Config
from lmstack.models.adapter_save import (
    ADAPTER_FILE,
    check_adapter_file,
    follow_umask,
    is_fsdp_peft,
    load_fsdp_adapter,
    save_fsdp_adapter,
)
from lmstack.reliability import NonFiniteLoss, TrainingStopped
from lmstack.reliability.callbacks import ReliabilityCallback
from lmstack.reliability.checkpoint import (
    checkpoint_step,
    commit_checkpoint,
    rotate_checkpoints,
    staging_root,
)
from lmstack.reliability.signals import StopSignals, workers_ignore_stop_signals

logger = logging.getLogger(__name__)


class ReliableMixin:
    """Mixed in before a transformers/TRL Trainer class; see the module docstring."""

    def __init__(
        self, *args: Any, lmstack_cfg: Config, lmstack_plan: dict | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._lm_cfg = lmstack_cfg
        self._lm_plan = lmstack_plan  # RunPlan.to_dict(): recorded in run_manifest.json
        if lmstack_cfg.training.on_nonfinite == "skip" and lmstack_cfg.training.deepspeed:
            raise ConfigError(
                "on_nonfinite: skip does not work with deepspeed (its engine steps the optimizer); "
                "use on_nonfinite: abort"
            )
        self._lm_signals = StopSignals()
        self._lm_nonfinite = False
        self._lm_last_bad_loss: float | None = None
        self._lm_skip_update = False
        self._lm_skipped: list[int] = []
        self._lm_stop_signal = 0
        self._lm_stop_step = 0
        self._lm_staging: Path | None = None
        self._lm_run: dict | None = None  # manifest.run_identity, stored in every checkpoint's manifest
        self.add_callback(ReliabilityCallback(self))

    # ---- train: signals + run manifest ----------------------------------------------------------
    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        if self.args.should_save:
            from lmstack.reliability.manifest import run_identity, write_run_manifest

            write_run_manifest(self._lm_cfg, resumed_from=resume_from_checkpoint, plan=self._lm_plan)
            self._lm_run = run_identity(self._lm_cfg, (self._lm_plan or {}).get("decisions"))
        resumed_step = None
        if isinstance(resume_from_checkpoint, str):
            self._lm_check_layout(Path(resume_from_checkpoint))
            resumed_step = checkpoint_step(Path(resume_from_checkpoint))
            self._lm_refuse_step_past_end(resumed_step)
        self._lm_signals.install()
        try:
            result = super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self._lm_signals.restore()
        if resumed_step is not None and self.state.global_step == resumed_step:
            logger.warning(
                "resume: %s is the run's last step: no step trained; the final outputs are written from it "
                "(the first attempt was stopped while writing them; its train metrics were not saved, so "
                "train_results.json has no train_loss)",
                resume_from_checkpoint,
            )
            result = result._replace(metrics={k: v for k, v in result.metrics.items() if k != "train_loss"})
        if self._lm_stop_signal and self.state.global_step < self.state.max_steps:
            name = signal.Signals(self._lm_stop_signal).name
            where = Path(self.args.output_dir) / f"checkpoint-{self._lm_stop_step}"
            raise TrainingStopped(
                f"stopped by {name} after step {self._lm_stop_step}; saved {where}; continue with "
                "resume_from_checkpoint: auto",
                exit_code=128 + self._lm_stop_signal,
            )
        return result

    def get_train_dataloader(self, *args: Any, **kwargs: Any) -> Any:
        return workers_ignore_stop_signals(super().get_train_dataloader(*args, **kwargs))

    def get_eval_dataloader(self, *args: Any, **kwargs: Any) -> Any:
        return workers_ignore_stop_signals(super().get_eval_dataloader(*args, **kwargs))

    def _lm_finishes_from_checkpoint(self) -> bool:
        """The base trainer has the per-epoch hook that `_run_epoch` guards (transformers 5.x)."""
        return callable(getattr(super(), "_run_epoch", None))

    def _lm_refuse_step_past_end(self, step: int | None) -> None:
        if step is None or self.args.max_steps <= 0 or step < self.args.max_steps:
            return
        if not self._lm_finishes_from_checkpoint():
            raise LmstackError(
                f"resume_from_checkpoint: checkpoint-{step} is the run's last step (max_steps "
                f"{self.args.max_steps}) and this transformers version would train one more step; resume "
                "from an earlier checkpoint-N, or raise max_steps"
            )

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        if 0 < self.state.max_steps <= self.state.global_step:  # resumed from the last step
            self.control.should_training_stop = True
            return None
        return super()._run_epoch(*args, **kwargs)

    def _lm_check_layout(self, checkpoint: Path) -> None:
        """Restores the skip count; warns when the process count differs from the checkpoint's."""
        import json

        from lmstack.reliability.checkpoint import MANIFEST

        try:
            manifest = json.loads((checkpoint / MANIFEST).read_text())
        except (OSError, ValueError):
            return
        self._lm_skipped = list(manifest.get("nonfinite_skipped_steps") or [])
        saved = manifest.get("world_size")
        if saved is not None and saved != self.args.world_size:
            logger.warning(
                "resume: %s was saved by %d processes, this run has %d: model and optimizer load, but "
                "the per-rank RNG states and the data order differ, so the run will not match an "
                "uninterrupted one; resume with %d processes for an exact continuation",
                checkpoint,
                saved,
                self.args.world_size,
                saved,
            )

    # ---- non-finite loss ------------------------------------------------------------------------
    def training_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        import torch

        loss = super().training_step(model, inputs, *args, **kwargs)
        if not bool(torch.isfinite(loss.detach()).all()):
            self._lm_nonfinite = True
            self._lm_last_bad_loss = float(loss.detach().float().mean())
        return loss

    def _lm_on_nonfinite(self, step: int) -> None:
        policy, budget = self._lm_cfg.training.on_nonfinite, self._lm_cfg.training.nonfinite_skip_budget
        loss = self._lm_last_bad_loss
        where = f"step {step}: the loss is {loss if loss is not None else 'non-finite'} (on another rank if not here)"
        if policy == "abort":
            raise NonFiniteLoss(
                f"{where}; on_nonfinite: abort stops the run (the last checkpoint is intact). Lower "
                "learning_rate, check the data at this step, or set on_nonfinite: skip"
            )
        if len(self._lm_skipped) >= budget:
            raise NonFiniteLoss(
                f"{where}; on_nonfinite: skip already skipped {len(self._lm_skipped)} steps "
                f"({self._lm_skipped}), nonfinite_skip_budget: {budget} is used up"
            )
        self._lm_skipped.append(step)
        self._lm_skip_update = True
        logger.warning(
            "%s; on_nonfinite: skip -> no parameter update this step (%d/%d skips used)",
            where,
            len(self._lm_skipped),
            budget,
        )

    def _lm_guard_optimizer(self) -> None:
        opt = self.optimizer
        if opt is None or getattr(opt, "_lmstack_guarded", False):
            return
        step = opt.step

        @functools.wraps(step)
        def guarded_step(*args: Any, **kwargs: Any) -> Any:
            if self._lm_skip_update:
                self._lm_skip_update = False
                return None
            return step(*args, **kwargs)

        opt.step = guarded_step
        opt._lmstack_guarded = True

    def _maybe_log_save_evaluate(self, tr_loss: Any, *args: Any, **kwargs: Any) -> Any:
        import torch

        out = super()._maybe_log_save_evaluate(tr_loss, *args, **kwargs)
        # NaN - NaN stays NaN: once a non-finite step has been logged (shown as NaN), clear it so
        # the next logged losses are real again.
        if self._globalstep_last_logged == self.state.global_step and not bool(torch.isfinite(tr_loss).all()):
            tr_loss.zero_()
        return out

    # ---- staged, manifest-committed checkpoints ------------------------------------------------
    def _get_output_dir(self, trial: Any) -> str:
        if self._lm_staging is not None:
            return str(self._lm_staging)
        return super()._get_output_dir(trial)

    def _lm_check_shared(self, staged: Path) -> None:
        """Every rank writes its RNG state into the checkpoint rank 0 commits: one that is missing means
        that rank's output_dir is another folder (nodes without a shared file system). A resume would then
        put the ranks at different steps and hang, so the run stops here, saying why."""
        world = self.args.world_size
        if world <= 1:
            return
        missing = [r for r in range(world) if not (staged / f"rng_state_{r}.pth").is_file()]
        if missing:
            raise ConfigError(
                f"output_dir: {self.args.output_dir} is not the folder every process writes to: "
                f"{staged.name} lacks rng_state_<rank>.pth of rank(s) {', '.join(map(str, missing))} of {world}. "
                "Multi-node training needs one output_dir on a file system every node shares (lmstack keeps "
                "save_on_each_node: false); give all nodes the same shared path"
            )

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if trial is not None:
            return super()._save_checkpoint(model, trial)
        step = self.state.global_step
        out = Path(self.args.output_dir)
        root = staging_root(out, step)
        if self.args.should_save:
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
        self.accelerator.wait_for_everyone()
        self._lm_staging = root
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._lm_staging = None
        if is_fsdp_peft(self):  # the Trainer's FSDP adapter save selects nothing (see adapter_save)
            save_fsdp_adapter(self, str(root / f"checkpoint-{step}"))
            if self.args.should_save:
                check_adapter_file(root / f"checkpoint-{step}")
        self.accelerator.wait_for_everyone()  # every rank's files (rng_state_<rank>.pth, shards) are written
        self._lm_best_outside_staging(root, out)
        if self.args.should_save:
            follow_umask(root / f"checkpoint-{step}")  # safetensors writes 0600; the umask decides
            self._lm_check_shared(root / f"checkpoint-{step}")
            meta = {
                "step": step,
                "epoch": self.state.epoch,
                "world_size": self.args.world_size,
                "stage": self._lm_cfg.finetuning.stage,
                "finetuning_type": self._lm_cfg.finetuning.finetuning_type,
                "nonfinite_skipped_steps": self._lm_skipped,  # the skip budget carries over a resume
                "outputs_from_checkpoint": self._lm_finishes_from_checkpoint(),  # see _run_epoch
                **(self._lm_run or {}),  # run + run_hash: a resume refuses changed settings
            }
            final = commit_checkpoint(root / f"checkpoint-{step}", out / f"checkpoint-{step}", meta)
            shutil.rmtree(root, ignore_errors=True)
            logger.info("checkpoint complete: %s", final)
            best = self.state.best_model_checkpoint
            rotate_checkpoints(out, self.args.save_total_limit, keep=(best,) if best else ())
        self.accelerator.wait_for_everyone()

    def _lm_best_outside_staging(self, root: Path, out: Path) -> None:
        """The Trainer records the best checkpoint (load_best_model_at_end) under the folder it saved
        into, the staging root; it is committed to output_dir/checkpoint-N, so the state (and the staged
        trainer_state.json that a resume reads) names that folder."""
        best = self.state.best_model_checkpoint
        if not best or Path(best).parent != root:
            return
        self.state.best_model_checkpoint = str(out / Path(best).name)
        staged = root / f"checkpoint-{self.state.global_step}" / "trainer_state.json"
        if self.args.should_save and staged.is_file():
            self.state.save_to_json(str(staged))

    # ---- FSDP + LoRA: the adapter comes back from the verified adapter file ----------------------
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if is_fsdp_peft(self) and (Path(resume_from_checkpoint) / ADAPTER_FILE).is_file():
            count = load_fsdp_adapter(self, resume_from_checkpoint)
            logger.info("resume: %d adapter tensors loaded from %s", count, resume_from_checkpoint)
            return
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if is_fsdp_peft(self) and best and (Path(best) / ADAPTER_FILE).is_file():
            logger.info("best model: %d adapter tensors loaded from %s", load_fsdp_adapter(self, best), best)
            return
        super()._load_best_model()

    # ---- loads: a file that is not plain tensors is refused, never run --------------------------
    def _lm_safe_load(self, what: str, checkpoint: str | None, load: Any) -> None:
        try:
            load(checkpoint)
        except pickle.UnpicklingError as err:
            raise LmstackError(
                f"resume_from_checkpoint: {checkpoint}: the {what} file holds pickled objects that are "
                f"not plain tensors; refused to unpickle it (torch.load weights_only=True). The checkpoint "
                f"was not written by this training run or was tampered with; resume from another one. "
                f"({str(err).splitlines()[0]})"
            ) from None

    def _load_rng_state(self, checkpoint: str | None) -> None:
        self._lm_safe_load("RNG state", checkpoint, super()._load_rng_state)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        self._lm_safe_load("optimizer/scheduler", checkpoint, super()._load_optimizer_and_scheduler)
