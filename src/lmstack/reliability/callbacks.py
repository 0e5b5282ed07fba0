"""The reliability layer's Trainer callbacks (public transformers hooks): the per-step agreement of all
ranks on a stop signal or a non-finite loss (`ReliabilityCallback`, ReliableMixin trainers), and the
checkpoint manifest written last for trainers without ReliableMixin (`CheckpointManifest`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from lmstack.config.schema import Config
from lmstack.launch.dist import barrier
from lmstack.reliability.checkpoint import MANIFEST, write_manifest
from lmstack.reliability.manifest import run_identity

logger = logging.getLogger(__name__)


def _all_ranks_max(values: list[float], device: Any) -> list[float]:
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def _follow_cadence(args: Any, state: Any) -> None:
    """A resume loads the checkpoint's trainer state, which holds that run's logging/eval/save steps
    (the Trainer would keep them): this run's values apply (a safe change, see output_dir.py)."""
    state.compute_steps(args, state.max_steps)


class ReliabilityCallback(TrainerCallback):
    """Once per optimizer step, all ranks agree on (stop signal, non-finite loss) of `trainer` (a
    ReliableMixin trainer, whose state this callback reads and sets)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        _follow_cadence(args, state)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        trainer = self.trainer
        trainer._lm_guard_optimizer()
        signum, nonfinite = _all_ranks_max(
            [float(trainer._lm_signals.received), float(trainer._lm_nonfinite)], args.device
        )
        trainer._lm_nonfinite = False
        if signum and not trainer._lm_stop_signal:
            trainer._lm_stop_signal = int(signum)
        trainer._lm_skip_update = False
        if nonfinite:
            trainer._lm_on_nonfinite(state.global_step + 1)

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self.trainer
        if trainer._lm_stop_signal and not trainer._lm_stop_step:
            trainer._lm_stop_step = state.global_step
            control.should_save = True  # even with save_strategy: no, a stop request saves
            control.should_training_stop = True


class CheckpointManifest(TrainerCallback):
    """For trainers without ReliableMixin (no staging): the manifest is still written last, after
    every rank has saved, so resume never picks a half-written checkpoint. With `cfg`, it records the
    run (config and data; these trainers get no plan) so a resume can refuse changed settings."""

    def __init__(self, cfg: Config | None = None) -> None:
        self.cfg = cfg
        self.run: dict | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        _follow_cadence(args, state)

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if not folder.is_dir() or (folder / MANIFEST).is_file():
            return  # ReliableMixin trainers commit with the manifest already
        barrier()
        if state.is_world_process_zero:
            if self.cfg is not None and self.run is None:
                self.run = run_identity(self.cfg, None)
            write_manifest(folder, {"step": state.global_step, "epoch": state.epoch, **(self.run or {})})
            logger.info("checkpoint complete: %s", folder)
        barrier()
