"""The launcher step of `lmstack train`, between config validation and the stage:

1. conflict rules (launch/rules.py) and DeepSpeed JSON validation — errors fire before any launch;
2. relaunch under torchrun when asked (launch/torchrun.py);
3. in the worker: TORCH_CUDA_ARCH_LIST normalisation for DeepSpeed, the FSDP wrap class, and the
   datasets tokenized once by the main process of each node while the others wait (bounded).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import MutableMapping
from pathlib import Path

from lmstack.config.schema import Config
from lmstack.launch import deepspeed as ds
from lmstack.launch import fsdp, torchrun
from lmstack.launch.rules import LaunchContext, apply_rules

logger = logging.getLogger(__name__)


def launch_context(cfg: Config, env: MutableMapping[str, str]) -> LaunchContext:
    ds_config = ds.load_deepspeed_config(cfg.training.deepspeed) if cfg.training.deepspeed else None
    return LaunchContext(
        deepspeed_config=ds_config,
        fsdp=fsdp.fsdp_requested(env),
        world_size=int(env.get("WORLD_SIZE", "1") or 1),
    )


def check(cfg: Config, env: MutableMapping[str, str] | None = None) -> list[str]:
    """Rules + DeepSpeed validation; returns the notes of applied fallbacks (errors raise)."""
    env = os.environ if env is None else env
    return apply_rules(cfg, launch_context(cfg, env))


def require_packages(cfg: Config) -> None:
    if cfg.training.deepspeed:
        ds.check_installed()


def _is_rank_zero(env: MutableMapping[str, str]) -> bool:
    return env.get("RANK", "0") == "0"


def relaunch_if_needed(
    cfg: Config, config_path: str | None, overrides: list[str] | dict | None, env=None
) -> dict | None:
    """Runs the whole job under torchrun and returns its metrics, or None to train in this process."""
    env = os.environ if env is None else env
    if not torchrun.should_relaunch(from_cli=config_path is not None, env=env):
        return None
    check(cfg, env)  # conflicts and a bad DeepSpeed JSON fail here, before any process starts
    require_packages(cfg)
    child_env = dict(env)
    if cfg.training.deepspeed:
        note = ds.normalize_arch_list(child_env)
        if note:
            logger.info(note)
    if config_path is None:  # in-process call with FORCE_TORCHRUN=1: hand the flat config over as a file
        handle = tempfile.NamedTemporaryFile(
            "w", suffix=".yaml", prefix="lmstack_launch_", delete=False, encoding="utf-8"
        )
        import yaml

        with handle:
            yaml.safe_dump(dict(overrides or {}), handle, sort_keys=False, allow_unicode=True)
        config_path, overrides = handle.name, None
        logger.info("config for the workers written to %s", config_path)
    torchrun.relaunch(config_path, overrides, child_env)
    results = Path(cfg.training.output_dir) / "all_results.json"
    return json.loads(results.read_text()) if results.is_file() else {}


def prepare_worker(cfg: Config, env: MutableMapping[str, str] | None = None) -> None:
    """Runs in the process that trains: logs the rule notes once, fixes the environment."""
    env = os.environ if env is None else env
    notes = check(cfg, env)
    if _is_rank_zero(env):
        for note in notes:
            logger.warning(note)
    require_packages(cfg)
    if cfg.training.deepspeed:
        note = ds.normalize_arch_list(env)
        if note and _is_rank_zero(env):
            logger.info(note)
    note = fsdp.fill_wrap_class(cfg.model.model_name_or_path, cfg.model.trust_remote_code, env)
    if note and _is_rank_zero(env):
        logger.info(note)


def deepspeed_for_trainer(cfg: Config) -> dict | None:
    """The DeepSpeed config handed to TrainingArguments: the validated JSON with lmstack's own
    "auto" values resolved (the Trainer fills the rest)."""
    if not cfg.training.deepspeed:
        return None
    config = ds.load_deepspeed_config(cfg.training.deepspeed)
    return ds.resolve_config(config, bf16=cfg.training.bf16, fp16=cfg.training.fp16)
