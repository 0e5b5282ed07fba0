"""The launcher step of `lmstack train`, between the checked run plan and the stage:

1. relaunch under torchrun when asked (launch/torchrun.py), or run on Ray Train workers under USE_RAY=1
   (launch/ray.py); the plan was checked before, so conflicts and a bad DeepSpeed JSON fail before any
   process starts;
2. in the worker: the fallback notes said once, TORCH_CUDA_ARCH_LIST normalised for DeepSpeed, the
   FSDP wrap class filled for an accelerate FSDP launch.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING

from lmstack.launch import deepspeed as ds
from lmstack.launch import fsdp, torchrun

if TYPE_CHECKING:  # the plan is built above this floor; only its type is named here
    from lmstack.plan.runplan import RunPlan

logger = logging.getLogger(__name__)


def relaunch_if_needed(
    plan: RunPlan, config_path: str | None, overrides: list[str] | dict | None, env=None
) -> dict | None:
    """Runs the whole job under torchrun or on Ray and returns its metrics, or None to train in this process."""
    env = os.environ if env is None else env
    if plan.ray is not None:
        from lmstack.launch import ray

        config_path, overrides = _config_file(config_path, overrides)
        ray.run(plan, config_path, torchrun.override_args(overrides))
        return _results(plan)
    if not torchrun.should_relaunch(from_cli=config_path is not None, env=env):
        return None
    if plan.deepspeed is not None:
        ds.check_installed()
    child_env = dict(env)
    if plan.deepspeed is not None:
        note = ds.normalize_arch_list(child_env)
        if note:
            logger.info(note)
    config_path, overrides = _config_file(config_path, overrides)
    torchrun.relaunch(config_path, overrides, child_env, allocator=plan.allocator.setting)
    return _results(plan)


def _config_file(config_path: str | None, overrides: list[str] | dict | None):
    """An in-process call (FORCE_TORCHRUN=1 / USE_RAY=1) hands its flat config to the workers as a file."""
    if config_path is not None:
        return config_path, overrides
    handle = tempfile.NamedTemporaryFile(
        "w", suffix=".yaml", prefix="lmstack_launch_", delete=False, encoding="utf-8"
    )
    import yaml

    with handle:
        yaml.safe_dump(dict(overrides or {}), handle, sort_keys=False, allow_unicode=True)
    logger.info("config for the workers written to %s", handle.name)
    return handle.name, None


def _results(plan: RunPlan) -> dict:
    results = Path(plan.cfg.training.output_dir) / "all_results.json"
    return json.loads(results.read_text()) if results.is_file() else {}


def prepare_worker(plan: RunPlan, notes: list[str], env: MutableMapping[str, str] | None = None) -> None:
    """Runs in the process that trains: logs the rule notes once, fixes the environment."""
    env = os.environ if env is None else env
    if plan.is_main:
        for note in notes:
            logger.warning(note)
    if plan.deepspeed is not None:
        ds.check_installed()
        note = ds.normalize_arch_list(env)
        if note and plan.is_main:
            logger.info(note)
    cfg = plan.cfg
    if plan.fsdp is not None and plan.fsdp.source == "accelerate":
        note = fsdp.fill_wrap_class(cfg.model.model_name_or_path, cfg.model.trust_remote_code, env)
        if note and plan.is_main:
            logger.info(note)
