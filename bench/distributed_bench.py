"""DDP / DeepSpeed ZeRO-2, ZeRO-3, ZeRO-3+offload / FSDP through lmstack's real launch paths, on one or
more GPUs of one host; one JSON line per run in bench/results/distributed.jsonl (and in
$OUT/distributed.jsonl when OUT is set).

    python3 bench/distributed_bench.py all --assets /tmp/assets --nproc 2 [--only 0.5b_full:z3,7b_lora:fsdp]
                                           [--budget 540] [--steps 20] [--run-id ID]
    python3 bench/distributed_bench.py worker CFG.yaml RESULT_PREFIX      (internal: one rank's run)

Workloads are the speed benchmark's lmstack settings (bench/lmstack_bench.py: packing without
cross-sample attention, fused linear CE, bf16 adapters, `gradient_checkpointing: auto`, cutoff 2048):
`0.5b_full` (Qwen2.5-0.5B architecture, full SFT, 32 rows x 2048 tokens per GPU) and `7b_lora`
(Qwen2.5-7B architecture, LoRA rank 8 on all linear layers, 4 x 2048 per GPU); per-GPU batch fixed, so
N GPUs process N times the tokens per step and tokens/s measures the scaling.

Launch forms, as users run them:
  DDP / DeepSpeed: python -m torch.distributed.run --nproc_per_node N <worker> cfg.yaml   (DeepSpeed: `deepspeed:` in cfg)
  FSDP:            python -m accelerate.commands.launch --config_file examples/accelerate/fsdp_config.yaml
                   --num_processes N <worker> cfg.yaml
The worker is `lmstack train` plus a callback (bench code only) that times the steady state exactly as
the speed benchmark does (real tokens between the end of step WARMUP and the end of training over the
CUDA-synchronised wall time; num_input_tokens_seen is summed over ranks) and records each rank's peak
memory. LoRA runs also check the saved adapter: every tensor non-empty, lora_B trained (ZeRO-3 gathers).
Needs deepspeed (+ hjson, pydantic) importable: PYTHONPATH=/tmp/site_lm:src as bench/device.sh sets it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchproc import run_killable  # noqa: E402
from lmstack_bench import COMMON, FULL, LM_BEST, LORA  # noqa: E402  (the speed benchmark's settings)

REPO = Path(__file__).resolve().parents[1]
WARMUP = 5
STRATEGIES = {
    "ddp": {},
    "z2": dict(deepspeed="examples/deepspeed/ds_z2_config.json"),
    "z3": dict(deepspeed="examples/deepspeed/ds_z3_config.json"),
    "z3_offload": dict(deepspeed="examples/deepspeed/ds_z3_offload_config.json"),
    "fsdp": dict(accelerate="examples/accelerate/fsdp_config.yaml"),
}
WORKLOADS = {  # name: (arch, method, settings)
    "0.5b_full": ("qwen2.5-0.5b", "full", {**FULL, "per_device_train_batch_size": 32}),
    "7b_lora": ("qwen2.5-7b", "lora", {**LORA, "per_device_train_batch_size": 4}),
    "0.5b_lora": ("qwen2.5-0.5b", "lora", {**LORA, "per_device_train_batch_size": 32}),
}
DEFAULT_MATRIX = (
    "0.5b_full:ddp,0.5b_full:z2,0.5b_full:z3,0.5b_full:fsdp,0.5b_full:z3_offload,"
    "7b_lora:z3,7b_lora:fsdp,7b_lora:z2,7b_lora:z3_offload"
)


def train_cfg(assets: Path, workload: str, strategy: str, steps: int, out: Path) -> dict:
    arch, _, settings = WORKLOADS[workload]
    cfg = {**COMMON, **LM_BEST, **settings, "max_steps": steps, "logging_steps": 1,
           "model_name_or_path": str(assets / arch), "dataset_dir": str(assets / "data"), "output_dir": str(out),
           "save_strategy": "no"}  # fmt: skip
    if "deepspeed" in STRATEGIES[strategy]:
        cfg["deepspeed"] = str(REPO / STRATEGIES[strategy]["deepspeed"])
    return cfg


def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("torch", "transformers", "peft", "accelerate", "deepspeed", "liger_kernel"):
        try:
            out[name] = md.version(name.replace("_", "-"))
        except md.PackageNotFoundError:
            out[name] = None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    out["lmstack_commit"] = commit.stdout.strip() or None
    return out


# ---- worker: one rank of `lmstack train` with a measuring callback -----------------------------------
def worker(cfg_path: str, result_prefix: str) -> int:
    import torch
    from transformers import TrainerCallback

    import lmstack.train.common as common
    from lmstack.cli.main import main

    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available()  # CPU (gloo) only for checking this script with the tiny model
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gib = lambda fn: round(fn() / 2**30, 3) if cuda else None  # noqa: E731

    class Measure(TrainerCallback):
        t0 = tok0 = None
        losses: list[float] = []

        master_weights = None

        def on_train_begin(self, args, state, control, **kw):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            opt = kw.get("optimizer")
            inner = getattr(opt, "optimizer", opt)  # accelerate wraps the Trainer's optimizer
            self.master_weights = "optimizer" if type(inner).__name__ == "Fp32MasterWeights" else "model"

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == WARMUP:
                sync()
                self.t0, self.tok0 = time.perf_counter(), state.num_input_tokens_seen

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

        def on_train_end(self, args, state, control, **kw):
            sync()
            t1, tok1 = time.perf_counter(), state.num_input_tokens_seen
            steady_steps = state.global_step - WARMUP
            row = {
                "rank": rank,
                "steps": state.global_step,
                "master_weights": self.master_weights,
                "peak_alloc_gib": gib(torch.cuda.max_memory_allocated),
                "peak_reserved_gib": gib(torch.cuda.max_memory_reserved),
            }
            if rank == 0 and self.t0 is not None and steady_steps > 0:
                row.update(steady_tokens_per_sec=round((tok1 - self.tok0) / (t1 - self.t0)),
                           steady_tokens=tok1 - self.tok0, step_time_s=round((t1 - self.t0) / steady_steps, 4),
                           first_loss=self.losses[0] if self.losses else None,
                           loss_after_steps=self.losses[-1] if self.losses else None)  # fmt: skip
            Path(f"{result_prefix}.rank{rank}.json").write_text(json.dumps(row))

    original = common.make_callbacks
    common.make_callbacks = lambda cfg: [*original(cfg), Measure()]
    return main(["train", cfg_path])


# ---- driver ------------------------------------------------------------------------------------------
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(strategy: str, nproc: int, cfg_path: Path, prefix: Path) -> list[str]:
    me = str(Path(__file__).resolve())
    if "accelerate" in STRATEGIES[strategy]:
        return [
            sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / STRATEGIES[strategy]["accelerate"]),
            "--num_processes", str(nproc), "--main_process_port", str(free_port()), me, "worker", str(cfg_path), str(prefix),
        ]  # fmt: skip
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port()),
        me, "worker", str(cfg_path), str(prefix),
    ]  # fmt: skip


def check_adapter(out: Path) -> dict:
    from safetensors.torch import load_file

    weights = load_file(out / "adapter_model.safetensors")
    empty = [k for k, t in weights.items() if t.numel() == 0]
    trained_b = sum(1 for k, t in weights.items() if "lora_B" in k and float(t.float().abs().sum()) > 0)
    n_b = sum(1 for k in weights if "lora_B" in k)
    return {
        "adapter_tensors": len(weights),
        "adapter_empty": len(empty),
        "lora_B_trained": f"{trained_b}/{n_b}",
    }


def predict(cfg: dict, nproc: int, fsdp: bool) -> dict | None:
    """The planner's per-GPU estimate for this exact config (allocated-equivalent: without its
    CUDA-context/fragmentation term, which max_memory_allocated does not see)."""
    try:
        from plan_accuracy import predict as plan_predict

        return plan_predict(cfg, 139.8, gpus=nproc, fsdp=fsdp)
    except Exception as err:  # noqa: BLE001 - a planner failure is recorded, the run stands
        return {"error": repr(err)[:300]}


def run_one(workload: str, strategy: str, args: argparse.Namespace, work: Path, timeout: float) -> dict:
    import yaml

    name = f"{workload}:{strategy}:{args.nproc}gpu"
    slug = name.replace(":", "_")
    out = work / slug
    cfg = train_cfg(Path(args.assets), workload, strategy, args.steps, out)
    if WORKLOADS[workload][1] == "lora":
        cfg["save_strategy"] = "no"  # the final save still happens; the adapter is checked below
    cfg_path, prefix = work / f"{slug}.yaml", work / slug
    cfg_path.write_text(yaml.safe_dump(cfg))
    for old in work.glob(f"{slug}.rank*.json"):
        old.unlink()
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    log = work / f"{slug}.log"
    start = time.monotonic()
    rc = run_killable(command(strategy, args.nproc, cfg_path, prefix), env, timeout, log)
    arch, method, settings = WORKLOADS[workload]
    row = {"system": "lmstack", "name": name, "model": arch, "method": method, "strategy": strategy,
           "num_gpus": args.nproc, "rc": rc, "wall_s": round(time.monotonic() - start, 1),
           "per_device_train_batch_size": settings["per_device_train_batch_size"], "cutoff_len": cfg["cutoff_len"],
           "config": {k: v for k, v in cfg.items() if k not in ("output_dir", "dataset_dir")}}  # fmt: skip
    ranks = [json.loads(p.read_text()) for p in sorted(work.glob(f"{slug}.rank*.json"))]
    for r in ranks:
        if r["rank"] == 0:
            row.update(
                {k: v for k, v in r.items() if k not in ("rank", "peak_alloc_gib", "peak_reserved_gib")}
            )
    if ranks and ranks[0]["peak_alloc_gib"] is not None:
        row["peak_alloc_gib"] = max(r["peak_alloc_gib"] for r in ranks)
        row["peak_reserved_gib"] = max(r["peak_reserved_gib"] for r in ranks)
        row["peak_alloc_gib_per_rank"] = [r["peak_alloc_gib"] for r in sorted(ranks, key=lambda r: r["rank"])]
    row["status"] = "ok" if rc == 0 and row.get("steady_tokens_per_sec") else "failed"
    if row["status"] != "ok":
        row["error_tail"] = log.read_text(errors="replace")[-2000:]
    elif method == "lora" and (out / "adapter_model.safetensors").is_file():
        row.update(check_adapter(out))
    row["predicted"] = predict(cfg, args.nproc, fsdp="accelerate" in STRATEGIES[strategy])
    pred = (row["predicted"] or {}).get("allocated_equiv")
    if pred and row.get("peak_alloc_gib"):
        row["plan_error_pct"] = round(100 * (pred - row["peak_alloc_gib"]) / row["peak_alloc_gib"], 1)
    return row


def run_all(args: argparse.Namespace) -> int:
    import torch

    deadline = time.time() + args.budget
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    meta = {
        "run_id": args.run_id or dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ"),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "versions": versions(),
        "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST"),
    }
    results = [REPO / "bench/results/distributed.jsonl"]
    if os.environ.get("OUT"):
        results.append(Path(os.environ["OUT"]) / "distributed.jsonl")
    failed = 0
    for item in (args.only or DEFAULT_MATRIX).split(","):
        workload, strategy = item.split(":")
        left = deadline - time.time()
        if left < 60:
            row = {
                "name": f"{item}:{args.nproc}gpu",
                "status": "skipped",
                "reason": f"budget: {left:.0f}s left",
            }
        else:
            row = run_one(workload, strategy, args, work, min(args.timeout, left))
        row = {**meta, **row, "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
        failed += row["status"] == "failed"
        line = json.dumps(row)
        print(f"{row['name']:28s} {row['status']:7s} tok/s {row.get('steady_tokens_per_sec')} "
              f"peak {row.get('peak_alloc_gib')} GiB pred {(row.get('predicted') or {}).get('allocated_equiv')} "
              f"loss {row.get('loss_after_steps')} wall {row.get('wall_s')}s", flush=True)  # fmt: skip
        for path in results:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as fh:
                fh.write(line + "\n")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("all")
    p.add_argument("--assets", default="/tmp/assets")
    p.add_argument("--nproc", type=int, default=1, help="GPUs (processes) per run")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--budget", type=float, default=540, help="seconds for all runs together")
    p.add_argument("--timeout", type=float, default=240, help="seconds for one run")
    p.add_argument("--work", default="/tmp/dist_bench")
    p.add_argument("--run-id", default=None)
    p.add_argument("--only", help=f"comma-separated WORKLOAD:STRATEGY items (default {DEFAULT_MATRIX})")
    p = sub.add_parser("worker")
    p.add_argument("cfg")
    p.add_argument("result")
    args = parser.parse_args()
    if args.cmd == "worker":
        return worker(args.cfg, args.result)
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
