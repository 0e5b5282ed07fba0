"""Process-group helpers for multi-process runs (train/stage_data.py tokenizes once per node with them).

The main process of each node tokenizes first and fills the content-keyed cache (data/cache.py); the
other ranks wait at a barrier bounded by `ddp_timeout` and then read the cache. If the wait expires
they stop with a message that says what to do — instead of NCCL's watchdog firing much later
(LLaMA-Factory's examples set ddp_timeout to 180000000 s).
"""

from __future__ import annotations

import logging
from datetime import timedelta

from lmstack.config.errors import LmstackError

logger = logging.getLogger(__name__)


def world_size() -> int:
    from lmstack.launch.context import topology

    return topology().world_size


def barrier() -> None:
    """All ranks meet here; a no-op in a single process (no process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def init_process_group(timeout_s: int, cuda: bool, local_rank: int) -> None:
    """Initialise the default group the way the Trainer would (accelerate and DeepSpeed reuse it)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    timeout = timedelta(seconds=timeout_s)
    if cuda:
        torch.cuda.set_device(local_rank)
        dist.init_process_group(backend="nccl", timeout=timeout)
    else:
        dist.init_process_group(backend="gloo", timeout=timeout)


def shutdown() -> None:
    """After a successful run: every rank meets, then the process groups are destroyed while the
    interpreter is alive. Without it, gloo's worker threads can outlive finalization and abort the
    process at exit ("terminate called without an active exception", SIGABRT; pytorch/pytorch#190489)
    after the run had finished. Not on a failure path: a rank stuck in a collective would hang it."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def barrier_group(timeout_s: int):
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def wait_for_main(timeout_s: int, rank: int, group, what: str) -> None:
    """A gloo barrier bounded by ddp_timeout; expiry raises an error naming the fix."""
    import torch.distributed as dist

    try:
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as err:
        raise LmstackError(
            f"rank {rank}: waited ddp_timeout={timeout_s} s for the main process ({what}) and gave up; "
            "raise ddp_timeout, or tokenize once beforehand with a single-process run so the cache is warm "
            f"({str(err).splitlines()[0]})"
        ) from None
