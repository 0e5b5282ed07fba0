"""`lmstack env`: versions, GPUs, and a one-tensor all-reduce across the visible GPUs
(the first check of a new machine: it proves the GPUs and NCCL work before any training).

Paste its output into bug reports. The all-reduce check spawns one NCCL process per GPU and sums
a tensor holding each rank's number; any other result (or a hang, bounded by a timeout) means the
GPUs cannot talk to each other and multi-GPU training would fail the same way.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform

PACKAGES = (
    "torch",
    "transformers",
    "peft",
    "trl",
    "accelerate",
    "deepspeed",
    "liger-kernel",
    "bitsandbytes",
    "flash-attn",
    "datasets",
)
ALLREDUCE_TIMEOUT_S = 120


def versions() -> dict[str, str | None]:
    import lmstack

    out: dict[str, str | None] = {"lmstack": lmstack.__version__, "python": platform.python_version()}
    out["platform"] = platform.platform()
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def gpus() -> dict:
    import torch

    info: dict = {"cuda_available": torch.cuda.is_available(), "cuda": torch.version.cuda, "gpus": []}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["gpus"].append(
                {
                    "index": i,
                    "name": p.name,
                    "memory_gib": round(p.total_memory / 2**30, 1),
                    "capability": f"{p.major}.{p.minor}",
                }
            )
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None
    return info


def _allreduce_worker(rank: int, world: int, port: int, results) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=ALLREDUCE_TIMEOUT_S),
    )
    tensor = torch.full((1,), float(rank + 1), device=f"cuda:{rank}")
    dist.all_reduce(tensor)
    torch.cuda.synchronize()
    results[rank] = float(tensor.item())
    dist.destroy_process_group()


def allreduce_check(world: int) -> tuple[bool, str]:
    """Sum of ranks 1..world on every GPU; returns (ok, one-line verdict)."""
    import torch.multiprocessing as mp

    from lmstack.launch.torchrun import free_port

    expected = world * (world + 1) / 2
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=_allreduce_worker, args=(r, world, port, results)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(ALLREDUCE_TIMEOUT_S)
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        for i in hung:
            procs[i].terminate()
        got = dict(results)
    if hung:
        return (
            False,
            f"NCCL all-reduce hung on rank(s) {hung} for {ALLREDUCE_TIMEOUT_S} s (check NCCL_* / P2P settings)",
        )
    bad = {r: v for r, v in got.items() if v != expected}
    if len(got) != world or bad:
        return False, f"NCCL all-reduce FAILED: expected {expected:g} on {world} GPUs, got {got}"
    return True, f"NCCL all-reduce OK on {world} GPUs (sum {expected:g} on every rank)"


def cmd_env(args: argparse.Namespace) -> int:
    report = {"versions": versions(), **gpus()}
    n = len(report["gpus"])
    if n > 1 and not args.no_allreduce:
        ok, verdict = allreduce_check(n)
        report["allreduce"] = {"ok": ok, "message": verdict}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for name, version in report["versions"].items():
            print(f"{name + ':':<16}{version or 'not installed'}")
        print(f"{'CUDA:':<16}{report['cuda'] or 'none (CPU build of torch)'}")
        if not n:
            print("GPUs:           no GPU visible; training runs on the CPU (multi-process uses gloo)")
        for g in report["gpus"]:
            print(f"GPU {g['index']}:          {g['name']}, {g['memory_gib']} GiB, sm {g['capability']}")
        if n == 1:
            print("all-reduce:     skipped (one GPU)")
        elif "allreduce" in report:
            print(f"all-reduce:     {report['allreduce']['message']}")
    return 0 if report.get("allreduce", {}).get("ok", True) else 1


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "env", help="print versions and GPUs; check that the GPUs can all-reduce (paste into bug reports)"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-allreduce", action="store_true", help="skip the multi-GPU all-reduce check")
    p.set_defaults(func=cmd_env)
