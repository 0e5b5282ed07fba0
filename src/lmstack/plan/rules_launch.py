"""The rules over how this run is launched and what this machine has installed (DeepSpeed, Ray Train),
in the LAUNCH_RULES of plan/rules.py: `lmstack train` applies them, `lmstack check` (which may run on
another machine than the job) does not. Same contract: nothing, a note, or ConfigError."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmstack.config.errors import ConfigError

if TYPE_CHECKING:  # annotations only
    from lmstack.plan.runplan import RunPlan


def deepspeed_installed(plan: RunPlan) -> str | None:
    # without a CUDA GPU the install advice is wrong (DeepSpeed then fails in mpi4py/its CUDA ops):
    # preflight's device check says what to do on this machine instead
    if plan.deepspeed is not None and plan.device == "cuda" and not plan.ctx.has("deepspeed"):
        raise ConfigError(
            "deepspeed: the `deepspeed` package is not installed; pip install deepspeed "
            "(or remove `deepspeed:` to train without ZeRO)"
        )
    return None


RAY_INSTALL = "pip install 'lmstack[ray]'"


def ray_installed(plan: RunPlan) -> str | None:
    if plan.ray is not None and not plan.ctx.has("ray"):
        raise ConfigError(
            f"USE_RAY=1: training on Ray needs the `ray` package (Ray Train), which is not installed; "
            f"{RAY_INSTALL}, or unset USE_RAY to train without Ray"
        )
    return None


def ray_launch(plan: RunPlan) -> str | None:
    """The Ray fields take effect under USE_RAY=1 only (LF's rule): set without it, they are refused
    rather than ignored; USE_RAY=1 with FORCE_TORCHRUN=1 asks for two launchers."""
    t, ctx = plan.cfg.training, plan.ctx
    if ctx.use_ray and ctx.force_torchrun and not ctx.under_launcher:
        raise ConfigError(
            "USE_RAY=1 and FORCE_TORCHRUN=1 both ask to launch the workers; keep USE_RAY=1 (Ray Train starts "
            "ray_num_workers processes) or FORCE_TORCHRUN=1 (torchrun starts NPROC_PER_NODE), not both"
        )
    if ctx.use_ray:
        return None
    given = [
        f"{name}: {value}"
        for name, value, default in (
            ("ray_num_workers", t.ray_num_workers, 1),
            ("ray_init_kwargs", t.ray_init_kwargs, None),
            ("master_addr", t.master_addr, None),
            ("master_port", t.master_port, None),
        )
        if value != default
    ]
    if given:
        raise ConfigError(
            f"{', '.join(given)}: these configure a Ray Train launch, which runs only with USE_RAY=1; "
            "run `USE_RAY=1 lmstack train ...`, or remove them to train without Ray (torchrun reads "
            "MASTER_ADDR / MASTER_PORT from the environment)"
        )
    return None
