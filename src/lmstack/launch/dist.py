"""Process-group helpers for multi-process runs: the datasets are tokenized once per node.

The main process of each node (LOCAL_RANK 0) tokenizes first and fills the content-keyed cache
(data/cache.py); the other ranks wait at a barrier bounded by `ddp_timeout` and then read the
cache. If the wait expires they stop with a message that says what to do — instead of NCCL's
watchdog firing much later (LLaMA-Factory's examples set ddp_timeout to 180000000 s).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

from lmstack.config.errors import LmstackError
from lmstack.config.schema import Config

logger = logging.getLogger(__name__)


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def barrier() -> None:
    """All ranks meet here; a no-op in a single process (no process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def init_process_group(cfg: Config) -> None:
    """Initialise the default group the way the Trainer would (accelerate and DeepSpeed reuse it)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    timeout = timedelta(seconds=cfg.training.ddp_timeout)
    if torch.cuda.is_available() and not cfg.training.use_cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="nccl", timeout=timeout)
    else:
        dist.init_process_group(backend="gloo", timeout=timeout)


def _tokenize(cfg: Config) -> None:
    from lmstack.data.pipeline import build_datasets
    from lmstack.models.load import load_tokenizer
    from lmstack.templates import get_template

    tokenizer = load_tokenizer(cfg)
    template = get_template(cfg.data.template, tokenizer)
    template.fix_tokenizer(tokenizer)  # the same steps as the stages, so the cache key matches
    build_datasets(cfg, tokenizer, template)


def barrier_group(cfg: Config):
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.training.ddp_timeout))


def wait_for_main(cfg: Config, group, what: str) -> None:
    """A gloo barrier bounded by ddp_timeout; expiry raises an error naming the fix."""
    import torch.distributed as dist

    timeout = timedelta(seconds=cfg.training.ddp_timeout)
    try:
        dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
    except RuntimeError as err:
        raise LmstackError(
            f"rank {os.environ.get('RANK', '?')}: waited ddp_timeout={cfg.training.ddp_timeout} s for "
            f"the main process ({what}) and gave up; raise ddp_timeout, or tokenize once beforehand "
            f"with a single-process run so the cache is warm ({str(err).splitlines()[0]})"
        ) from None


def tokenize_on_main_first(cfg: Config) -> None:
    """No-op in a single process. Otherwise: LOCAL_RANK 0 tokenizes, everybody meets, all go on."""
    if world_size() <= 1 or not cfg.data.dataset:
        return
    init_process_group(cfg)
    group = barrier_group(cfg)  # collective: created by every rank before anyone starts working
    if os.environ.get("LOCAL_RANK", "0") == "0":
        _tokenize(cfg)
    wait_for_main(cfg, group, "tokenizing the datasets")
