"""The bounded wait for the main process (data tokenized once): 2 gloo processes on CPU."""

from __future__ import annotations

import os
import time

import torch.multiprocessing as mp


def _until(results, key, guard_s: float = 120.0) -> None:
    """Polls the shared dict until `key` is in it (the guard only ends a hang)."""
    deadline = time.monotonic() + guard_s
    while key not in results and time.monotonic() < deadline:
        time.sleep(0.05)


def _worker(rank: int, port: int, flat: dict, main_until, results) -> None:
    import torch.distributed as dist

    from lmstack.config.errors import LmstackError
    from lmstack.config.load import build_config
    from lmstack.launch import dist as ldist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    timeout_s = build_config(flat).training.ddp_timeout
    ldist.init_process_group(timeout_s, False, rank)
    group = ldist.barrier_group(timeout_s)
    if rank == 0:
        _until(results, main_until)  # the "tokenizing" main process, done when the test's event comes
        results["main done"] = True
    else:
        results["rank 1 waiting"] = True
    try:
        ldist.wait_for_main(timeout_s, rank, group, "tokenizing the datasets")
        results[rank] = ("ok", "main done" in results)
    except LmstackError as err:
        results[rank] = (str(err), "main done" in results)
    except RuntimeError as err:  # rank 0 sees its peer give up
        results[rank] = (f"runtime: {err}", True)
    finally:
        if rank != 0 or results[rank][0] == "ok":
            dist.destroy_process_group()


def _run(base_cfg: dict, timeout_s: int, main_until) -> dict:
    from lmstack.launch.torchrun import free_port

    flat = {**base_cfg, "ddp_timeout": timeout_s, "use_cpu": True}
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, port, flat, main_until, results)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(300)  # a guard only: both ranks end on the events below
        for p in procs:
            if p.is_alive():
                p.kill()
        return dict(results)


def test_ranks_wait_for_the_main_process(base_cfg):
    # the main process finishes only once rank 1 is inside its wait: rank 1 must come out after it
    results = _run(base_cfg, timeout_s=120, main_until="rank 1 waiting")
    assert results[1] == ("ok", True)  # rank 1 really waited for rank 0
    assert results[0][0] == "ok"


def test_wait_is_bounded_by_ddp_timeout_with_a_clear_message(base_cfg):
    # the main process "tokenizes" until rank 1 has given up: an unbounded wait never returns
    results = _run(base_cfg, timeout_s=2, main_until=1)
    message, main_done = results[1]
    assert "rank 1: waited ddp_timeout=2 s for the main process (tokenizing the datasets)" in message
    assert "raise ddp_timeout" in message and not main_done


def test_ddp_skips_the_unused_parameter_search_unless_asked(base_cfg):
    """Trainer's default (True for a model without checkpointing) costs a graph walk per step."""
    from lmstack.config.load import build_config
    from lmstack.launch.context import LaunchContext
    from lmstack.plan.runplan import RunPlan
    from lmstack.train.common import training_arguments

    def args(flat: dict):
        return training_arguments(RunPlan.resolve(build_config(flat), LaunchContext()))

    assert args(base_cfg).ddp_find_unused_parameters is False
    assert args({**base_cfg, "ddp_find_unused_parameters": True}).ddp_find_unused_parameters is True


def _shutdown_worker(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    from lmstack.launch import dist as ldist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    ldist.init_process_group(60, False, rank)
    ldist.barrier_group(60)  # a second group: shutdown destroys it too
    ldist.shutdown()
    results[rank] = dist.is_initialized()
    ldist.shutdown()  # a no-op once the groups are gone


def test_shutdown_destroys_every_process_group_on_both_ranks():
    """train/run.py calls shutdown() after a finished stage: gloo groups left to interpreter finalization
    can abort a finished rank (SIGABRT, seen in CI's two-node test)."""
    from lmstack.launch.torchrun import free_port

    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=_shutdown_worker, args=(r, port, results)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0, 0]
        assert dict(results) == {0: False, 1: False}
