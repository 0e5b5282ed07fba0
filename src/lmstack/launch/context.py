"""`LaunchContext.from_env()`: the one place that reads how this process was launched and what
hardware and optional packages it sees, so the run plan decides from one snapshot.

Everything the YAML alone does not say lives here: the process topology (RANK, LOCAL_RANK,
WORLD_SIZE, NODE_RANK, NNODES, FORCE_TORCHRUN), a Ray Train launch (USE_RAY, LF's switch), an accelerate
FSDP launch (ACCELERATE_USE_FSDP and its FSDP_* variables), the user's own CUDA caching-allocator settings (PYTORCH_ALLOC_CONF /
PYTORCH_CUDA_ALLOC_CONF: they win over the plan's allocator decision), CUDA facts (devices, memory, bf16
support) and which optional accelerator packages are importable. The run plan (plan/runplan.py) and every part below it read this frozen
object instead of `os.environ` or `torch.cuda`.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

# optional packages whose presence changes a run decision (module name as imported)
OPTIONAL_PACKAGES = (
    "flash_attn",
    "flash_attn_interface",
    "liger_kernel",
    "deepspeed",
    "bitsandbytes",
    "unsloth",
    "torchao",
    "ray",
)
# torch's caching-allocator settings (`key:value,...`); the unified name first (torch >= 2.9), then the CUDA one
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
# ProcessGroupNCCL registers every allocator segment with NCCL (user buffer registration) when set
NCCL_REGISTER_HOOK_VAR = "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"
FSDP_STRATEGY_IDS = {"1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD", "4": "HYBRID_SHARD"}


def _true(value: str | None) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes")


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    try:
        return int(raw) if raw not in (None, "") else default
    except ValueError:
        return default


@dataclass(frozen=True)
class FsdpLaunch:
    """An accelerate FSDP launch, as its config reached this process through the environment."""

    sharding: str = "FULL_SHARD"
    version: int = 1
    wrap_policy: str = "TRANSFORMER_BASED_WRAP"
    wrap_classes: str = ""


@dataclass(frozen=True)
class LaunchContext:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    node_rank: int = 0
    nnodes: int = 1
    nproc_per_node: int | None = None  # NPROC_PER_NODE for lmstack's own torchrun relaunch
    under_launcher: bool = False  # inside a torchrun / accelerate / deepspeed worker
    force_torchrun: bool = False
    use_ray: bool = False  # USE_RAY=1 (LF's switch): the job runs on Ray Train workers (launch/ray.py)
    accelerate_fsdp: FsdpLaunch | None = None
    cuda: bool = False  # a CUDA device is visible
    gpu_count: int = 0
    gpu_memory_gib: float | None = None  # device 0's total memory
    bf16_supported: bool = False
    cuda_capability: tuple[int, int] | None = None  # device 0's (major, minor), e.g. (9, 0) on Hopper
    gpu_name: str | None = None
    hostname: str = ""
    packages: frozenset[str] = field(default_factory=frozenset)
    # (variable, value) of the allocator settings the environment already sets (ALLOC_CONF_VARS), or None
    alloc_conf: tuple[str, str] | None = None
    nccl_register_hook: bool = False  # NCCL_REGISTER_HOOK_VAR is on
    cpu_count: int = 1  # cores this process may run on (its affinity mask), shared by the node
    # `lmstack plan`'s machine planned for, in words, when it is not this one (its GPU is not visible)
    planned_for: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, probe_cuda: bool = True) -> LaunchContext:
        env = os.environ if env is None else env
        cuda, count, memory, bf16, capability, name = False, 0, None, False, None, None
        if probe_cuda:
            import torch

            if torch.cuda.is_available():
                cuda, count = True, torch.cuda.device_count()
                props = torch.cuda.get_device_properties(0)
                memory, capability, name = props.total_memory / 2**30, (props.major, props.minor), props.name
                bf16 = bool(torch.cuda.is_bf16_supported())
        return cls(
            rank=_int(env, "RANK", 0),
            local_rank=_int(env, "LOCAL_RANK", 0),
            world_size=max(_int(env, "WORLD_SIZE", 1), 1),
            node_rank=_int(env, "NODE_RANK", 0),
            nnodes=max(_int(env, "NNODES", 1), 1),
            nproc_per_node=_int(env, "NPROC_PER_NODE", 0) or None,
            under_launcher="LOCAL_RANK" in env or "WORLD_SIZE" in env,
            force_torchrun=_true(env.get("FORCE_TORCHRUN", "0")),
            use_ray=_true(env.get("USE_RAY", "0")),
            accelerate_fsdp=_fsdp_launch(env),
            cuda=cuda,
            gpu_count=count,
            gpu_memory_gib=memory,
            bf16_supported=bf16,
            cuda_capability=capability,
            gpu_name=name,
            hostname=socket.gethostname(),
            packages=frozenset(p for p in OPTIONAL_PACKAGES if importlib.util.find_spec(p) is not None),
            alloc_conf=next(((n, env[n].strip()) for n in ALLOC_CONF_VARS if env.get(n, "").strip()), None),
            nccl_register_hook=_true(env.get(NCCL_REGISTER_HOOK_VAR)),
            cpu_count=_usable_cpus(),
        )

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        return self.local_rank == 0

    def planned_world_size(self, cuda: bool) -> int:
        """Processes the job will run with: the launcher's world size inside a worker; else what
        lmstack's torchrun relaunch will start (FORCE_TORCHRUN, or several GPUs); else 1."""
        if self.under_launcher:
            return self.world_size
        gpus = self.gpu_count if cuda else 0
        if self.force_torchrun or gpus > 1:
            return self.nnodes * (self.nproc_per_node or max(gpus, 1))
        return 1

    def has(self, package: str) -> bool:
        return package in self.packages


def _usable_cpus() -> int:
    """Cores the scheduler lets this process use (a container's or taskset's limit), else the machine's."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # no affinity API on this platform
        return max(os.cpu_count() or 1, 1)


def _fsdp_launch(env: Mapping[str, str]) -> FsdpLaunch | None:
    if not _true(env.get("ACCELERATE_USE_FSDP")):
        return None
    raw = str(env.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD")).strip().upper()
    return FsdpLaunch(
        sharding=FSDP_STRATEGY_IDS.get(raw, raw),
        version=_int(env, "FSDP_VERSION", 1),
        wrap_policy=str(env.get("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP")).upper(),
        wrap_classes=env.get("FSDP_TRANSFORMER_CLS_TO_WRAP", ""),
    )


def topology() -> LaunchContext:
    """The process topology alone (no CUDA probe), for parts that run without a plan at hand:
    logging setup, rank-0-only writes in library code called outside `lmstack train`."""
    return LaunchContext.from_env(probe_cuda=False)
