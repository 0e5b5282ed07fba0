"""`lmstack train`: parse -> plan -> check -> (relaunch) -> stage.

cfg  = load_config(yaml, overrides)          validated, never mutated afterwards
ctx  = LaunchContext.from_env()              the only reader of RANK/WORLD_SIZE/... and CUDA facts
plan = RunPlan.resolve(cfg, ctx)             every derived decision, each with its reason
preflight.check(plan)                        every problem at once, before anything loads (exit 2)
apply_allocator(plan)                        plan.allocator, before the first CUDA allocation
STAGES[plan.stage.name](plan)
"""

from __future__ import annotations

import logging

from lmstack.config.load import load_config
from lmstack.config.schema import Config
from lmstack.launch.context import LaunchContext
from lmstack.plan.runplan import RunPlan

logger = logging.getLogger(__name__)


def plan_run(cfg: Config, ctx: LaunchContext | None = None, launch: bool = True) -> tuple[RunPlan, list[str]]:
    """The run plan of `cfg` in this process, checked; returns (plan, fallback notes)."""
    from lmstack.train import preflight

    plan = RunPlan.resolve(cfg, ctx or LaunchContext.from_env())
    return plan, preflight.check(plan, launch)


def apply_allocator(plan: RunPlan) -> bool:
    """Sets the CUDA caching allocator's mode the plan chose (expandable segments), in this process, before
    anything is allocated on the GPU: the model loads after, and torch.distributed starts after (its first
    collective allocates). Nothing without CUDA, nor when the user's own allocator variable is set (torch
    read it already). Returns whether a setting was applied."""
    setting = plan.allocator.setting
    if setting is None or plan.device != "cuda":
        return False
    import torch

    set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.9
    if set_settings is None:
        set_settings = torch.cuda.memory._set_allocator_settings
    set_settings(setting)
    return True


def keep_out_unused(plan: RunPlan) -> list[str]:
    """Marks the packages the plan found unused (plan.kept_out) as absent in this process, before
    transformers or peft is imported: their availability checks (`importlib.util.find_spec`) then see
    no package and skip importing it. Only for a process that is this run's alone (`lmstack train`):
    the mark lasts as long as the process. Returns the packages kept out."""
    from lmstack.launch.keep_out import keep_out

    return keep_out(plan.kept_out)


def train(
    config_path: str | None, overrides: list[str] | dict | None = None, own_process: bool = False
) -> dict:
    """`own_process`: the process runs this training only (the CLI), so the packages the plan does not
    use may be kept out of it (keep_out_unused)."""
    from lmstack.train import preflight

    cfg = load_config(config_path, overrides)
    plan = RunPlan.resolve(cfg, LaunchContext.from_env())
    # before the checks: the template check loads the tokenizer, which imports transformers
    kept = keep_out_unused(plan) if own_process else []
    notes = preflight.check(plan)
    if kept:
        logger.info("not imported (unused by this run): %s", ", ".join(kept))
    from lmstack.reliability.output_dir import finished_run
    from lmstack.reliability.run_lock import acquire

    # before anything is written; held till exit. One holder per job: rank 0 on the first node (each
    # node's launcher starts as rank 0; on storage the nodes share, a second holder would refuse the job)
    acquire(cfg.training.output_dir, plan.ctx.is_main and plan.ctx.node_rank == 0)

    done = finished_run(plan)  # a resume of a run that already reached its last step: nothing to do
    if done is not None:
        return done
    from lmstack.launch import prepare
    from lmstack.train import STAGES
    from lmstack.train.stage_data import tokenize_on_main_first

    # launcher: torchrun relaunch (CLI path with > 1 GPU, or FORCE_TORCHRUN=1); then in the worker the
    # environment fixes and the data tokenized once per node before the stage runs
    launched = prepare.relaunch_if_needed(plan, config_path, overrides)
    if launched is not None:
        return launched
    apply_allocator(plan)  # before the first CUDA allocation (the plan's describe() says which and why)
    prepare.prepare_worker(plan, notes)
    tokenize_on_main_first(plan)
    if plan.is_main:
        logger.info("%s", plan.describe())
    logger.info(
        "stage %s, finetuning_type %s, output_dir %s",
        plan.stage.name,
        cfg.finetuning.finetuning_type,
        cfg.training.output_dir,
    )
    result = STAGES[plan.stage.name](plan)
    from lmstack.launch.dist import shutdown

    shutdown()  # a torchrun worker: its process groups go before the interpreter does
    return result
