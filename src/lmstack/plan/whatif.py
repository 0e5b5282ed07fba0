"""`lmstack plan`'s question: what would this YAML need on N GPUs of M GiB? The run plan resolved
for that hypothetical machine, turned into the planner's request.

The machine planned for is the target, not the one planning: it is assumed to have every optional
package a strategy or the YAML needs (DeepSpeed, bitsandbytes, torchao, Liger; flash-attn / Unsloth
where the YAML names them), so the answer is the same on a laptop without DeepSpeed as on the cluster;
the plan says what to install there (memory/advice.target_installs). Only `lmstack train` checks the
machine it runs on (plan/rules.py).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

from lmstack.config.schema import Config
from lmstack.launch.context import OPTIONAL_PACKAGES, LaunchContext
from lmstack.memory.recommend import PlanRequest
from lmstack.plan.from_config import request_from_plan, yaml_packages
from lmstack.plan.runplan import RunPlan

# what a strategy of the planner needs on the target: ZeRO (deepspeed), QLoRA (bitsandbytes), FP8 full
# fine-tuning (torchao), Liger's fused loss (liger_kernel). flash-attn is not among them: `flash_attn: auto`
# picks flex/SDPA without it, and assuming it would make the answer depend on a package no row needs.
STRATEGY_PACKAGES = frozenset({"deepspeed", "bitsandbytes", "torchao", "liger_kernel"})


def target_packages(cfg: Config) -> frozenset[str]:
    """The optional packages assumed on the target for `cfg`: the strategies' and those the YAML names."""
    return (STRATEGY_PACKAGES | set(yaml_packages(cfg))) & frozenset(OPTIONAL_PACKAGES)


def gpu_context(
    gpus: int,
    gpu_memory_gib: float,
    gpu_capability: tuple[int, int] | None = None,
    gpu_name: str | None = None,
    packages: frozenset[str] = STRATEGY_PACKAGES,
    planned_for: str | None = None,
) -> LaunchContext:
    """The launch context of a hypothetical GPU job (what `lmstack plan --gpus N` plans for): `packages`
    are assumed installed there whatever this machine has. `gpu_capability` (major, minor) and
    `gpu_name`: the GPU's kind where known (FP8 needs sm89+); None leaves it unknown."""
    here = LaunchContext.from_env(probe_cuda=False)
    return replace(
        here,
        cuda=True,
        gpu_count=gpus,
        world_size=gpus,
        under_launcher=True,
        gpu_memory_gib=gpu_memory_gib,
        bf16_supported=True,
        cuda_capability=gpu_capability,
        gpu_name=gpu_name,
        packages=packages,
        planned_for=planned_for or f"planned for {gpus} x {gpu_name or 'CUDA GPU'} of {gpu_memory_gib:g} GiB",
    )


def plan_for(
    cfg: Config,
    gpus: int,
    gpu_memory_gib: float,
    gpu_capability: tuple[int, int] | None = None,
    gpu_name: str | None = None,
    planned_for: str | None = None,
) -> RunPlan:
    """The run plan of `cfg` on `gpus` GPUs of `gpu_memory_gib` (auto fields left for the planner);
    `planned_for`: the plan's device reason, the machine planned for in words."""
    ctx = gpu_context(gpus, gpu_memory_gib, gpu_capability, gpu_name, target_packages(cfg), planned_for)
    return RunPlan.resolve(cfg, ctx, resolve_auto=False)


def request_from_config(
    cfg: Config,
    gpus: int,
    gpu_memory_gib: float,
    nodes: int = 1,
    cpu_memory_gib: float | None = None,
    search: bool = False,
    data: bool = False,
    gpu_capability: tuple[int, int] | None = None,
    gpu_name: str | None = None,
) -> PlanRequest:
    """The request for `cfg` run on `gpus` x `nodes` GPUs: the run plan resolved for that machine.
    `data`: read the row lengths of an unpacked run from the data (plan/lengths.py); `gpu_capability` /
    `gpu_name`: the GPU's kind (gpu_context)."""
    run_plan = plan_for(cfg, gpus * nodes, gpu_memory_gib, gpu_capability, gpu_name)
    lengths = None
    if data:
        from lmstack.plan.lengths import data_lengths

        lengths = data_lengths(run_plan)
    return request_from_plan(run_plan, gpus, gpu_memory_gib, nodes, cpu_memory_gib, search, lengths=lengths)


def machine_memory_gib() -> float | None:
    """This machine's physical memory (the CPU RAM offload can use), None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def disk_free_gib(path: str) -> float | None:
    """Free disk where `path` (output_dir) is or will be created: its nearest existing parent."""
    here = Path(path).resolve()
    while not here.exists() and here != here.parent:
        here = here.parent
    try:
        return shutil.disk_usage(here).free / 2**30
    except OSError:
        return None
