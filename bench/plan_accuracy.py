"""Planner accuracy on the GPU: for a list of short real `lmstack train` runs, the planner's predicted
per-GPU peak vs the measured `torch.cuda.max_memory_allocated()`.

Usage (GPU machine, repo root, assets built by bench/make_assets.py):
    python3 bench/plan_accuracy.py ASSETS_ROOT OUT_JSON [--set small|big] [--only NAME,...]
Each run is a child process (`--child`) so peaks do not leak between runs. The prediction compared
is the planner's breakdown without its CUDA-context/fragmentation overhead term, because
max_memory_allocated counts neither (the overhead is still part of the fit decision).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
Z2, Z3, Z3OFF = (
    f"{REPO}/examples/deepspeed/ds_z2_config.json",
    f"{REPO}/examples/deepspeed/ds_z3_config.json",
    f"{REPO}/examples/deepspeed/ds_z3_offload_config.json",
)

# name, arch, overrides (all runs: packing on, bf16, sdpa unless said, 4 steps)
SMALL = [
    (
        "0.5b_full_mb2_s1024",
        "qwen2.5-0.5b",
        dict(finetuning_type="full", per_device_train_batch_size=2, cutoff_len=1024),
    ),
    ("0.5b_full_mb4_s2048", "qwen2.5-0.5b", dict(finetuning_type="full", per_device_train_batch_size=4)),
    (
        "0.5b_full_mb4_s2048_ckpt",
        "qwen2.5-0.5b",
        dict(finetuning_type="full", per_device_train_batch_size=4, gradient_checkpointing=True),
    ),
    (
        "0.5b_full_mb8_s2048_ckpt",
        "qwen2.5-0.5b",
        dict(finetuning_type="full", per_device_train_batch_size=8, gradient_checkpointing=True),
    ),
    (
        "0.5b_full_mb8_s2048_liger",
        "qwen2.5-0.5b",
        dict(finetuning_type="full", per_device_train_batch_size=8, enable_liger_kernel=True),
    ),
    ("0.5b_lora_mb4_s2048", "qwen2.5-0.5b", dict(per_device_train_batch_size=4)),
    (
        "0.5b_lora_mb8_s2048_ckpt",
        "qwen2.5-0.5b",
        dict(per_device_train_batch_size=8, gradient_checkpointing=True),
    ),
    ("0.5b_lora_mb2_s4096", "qwen2.5-0.5b", dict(per_device_train_batch_size=2, cutoff_len=4096)),
    (
        "0.5b_full_mb4_z2",
        "qwen2.5-0.5b",
        dict(finetuning_type="full", per_device_train_batch_size=4, deepspeed=Z2),
    ),
    (
        "0.5b_full_mb4_z3",
        "qwen2.5-0.5b",
        dict(finetuning_type="full", per_device_train_batch_size=4, deepspeed=Z3),
    ),
    (
        "0.5b_full_mb4_z3_offload",
        "qwen2.5-0.5b",
        dict(finetuning_type="full", per_device_train_batch_size=4, deepspeed=Z3OFF),
    ),
    ("0.5b_lora_mb4_z3", "qwen2.5-0.5b", dict(per_device_train_batch_size=4, deepspeed=Z3)),
    ("1.5b_full_mb2_s2048", "qwen2.5-1.5b", dict(finetuning_type="full", per_device_train_batch_size=2)),
    (
        "1.5b_full_mb4_s2048_ckpt",
        "qwen2.5-1.5b",
        dict(finetuning_type="full", per_device_train_batch_size=4, gradient_checkpointing=True),
    ),
    (
        "1.5b_full_mb8_liger",
        "qwen2.5-1.5b",
        dict(finetuning_type="full", per_device_train_batch_size=8, enable_liger_kernel=True),
    ),
    ("1.5b_lora_mb4_s2048", "qwen2.5-1.5b", dict(per_device_train_batch_size=4)),
    ("1.5b_lora_mb8_ckpt", "qwen2.5-1.5b", dict(per_device_train_batch_size=8, gradient_checkpointing=True)),
    (
        "1.5b_full_mb4_z2",
        "qwen2.5-1.5b",
        dict(finetuning_type="full", per_device_train_batch_size=4, deepspeed=Z2),
    ),
]
BIG = [
    ("7b_lora_mb2_ckpt", "qwen2.5-7b", dict(per_device_train_batch_size=2, gradient_checkpointing=True)),
    ("7b_lora_mb4", "qwen2.5-7b", dict(per_device_train_batch_size=4)),
    ("7b_lora_mb8_ckpt", "qwen2.5-7b", dict(per_device_train_batch_size=8, gradient_checkpointing=True)),
    ("7b_lora_mb4_liger", "qwen2.5-7b", dict(per_device_train_batch_size=4, enable_liger_kernel=True)),
]


def base_config(assets: str, arch: str, name: str, overrides: dict) -> dict:
    cfg = dict(
        model_name_or_path=f"{assets}/{arch}",
        template="qwen",
        stage="sft",
        do_train=True,
        finetuning_type="lora",
        lora_target="all",
        lora_rank=8,
        lora_alpha=16,
        dataset="synth",
        dataset_dir=f"{assets}/data",
        cutoff_len=2048,
        max_samples=1500,
        packing=True,
        preprocessing_num_workers=8,
        output_dir=f"/tmp/plan_acc/{name}",
        overwrite_output_dir=True,
        save_strategy="no",
        logging_steps=1,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        learning_rate=1e-5,
        max_steps=4,
        bf16=True,
        flash_attn="sdpa",
        gradient_checkpointing=False,
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    cfg.update(overrides)
    return cfg


def predict(
    cfg_dict: dict, gpu_gib: float, gpus: int = 1, fsdp: bool = False, seq_len: int | None = None
) -> dict:
    """The planner's per-GPU breakdown of the configured setup; `seq_len` replaces the data-aware row
    length (recomputing a run whose data is not at hand)."""
    import dataclasses

    from lmstack.config.load import build_config
    from lmstack.plan import plan
    from lmstack.plan.whatif import request_from_config

    req = request_from_config(build_config(cfg_dict), gpus, gpu_gib)
    if fsdp:
        req = dataclasses.replace(req, fsdp=True)
    if seq_len:
        req = dataclasses.replace(req, seq_len=seq_len)
    result = plan(req)
    if result.configured is None:
        raise ValueError("the planner found no estimate for the configured setup")
    parts = result.configured.estimate.gpu.to_dict()
    parts["allocated_equiv"] = parts["allocated"]  # the figure torch.cuda.max_memory_allocated() measures
    return parts


def child(spec: dict) -> None:
    import torch

    if spec["config"].get("deepspeed"):  # DeepSpeed wants a process group even on one GPU
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"])
        )
    from lmstack.train.run import train

    t0 = time.time()
    train(None, spec["config"])
    torch.cuda.synchronize()
    out = {
        "measured_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
        "reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3),
        "wall_s": round(time.time() - t0, 1),
    }
    print("RESULT " + json.dumps(out), flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("assets")
    ap.add_argument("out")
    ap.add_argument("--set", default="small", choices=["small", "big", "all"])
    ap.add_argument("--only", default="")
    ap.add_argument("--timeout", type=int, default=150)
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    import torch

    gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    runs = {"small": SMALL, "big": BIG, "all": SMALL + BIG}[args.set]
    if args.only:
        runs = [r for r in runs if r[0] in args.only.split(",")]
    results = json.load(open(args.out))["runs"] if os.path.exists(args.out) else []
    for name, arch, overrides in runs:
        cfg = base_config(args.assets, arch, name, overrides)
        row = {
            "name": name,
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "config": {k: v for k, v in cfg.items() if k not in ("dataset_dir", "output_dir")},
        }
        try:
            row["predicted"] = predict(cfg, gpu_gib)
            row["predicted_gib"] = row["predicted"]["allocated_equiv"]
        except Exception as err:  # a planner failure is a result too
            row["predicted_error"] = repr(err)
        spec = json.dumps({"config": cfg, "port": free_port()})
        try:
            proc = subprocess.run(
                [sys.executable, __file__, args.assets, args.out, "--child", spec],
                capture_output=True,
                text=True,
                timeout=args.timeout,
            )
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line:
                row.update(json.loads(line[7:]))
            else:
                row["error"] = (proc.stderr or proc.stdout)[-1500:]
        except subprocess.TimeoutExpired:
            row["error"] = f"timeout after {args.timeout}s"
        if "measured_gib" in row and "predicted_gib" in row:
            row["error_pct"] = round(
                100 * (row["predicted_gib"] - row["measured_gib"]) / row["measured_gib"], 1
            )
        print(
            f"{name:32s} pred {row.get('predicted_gib', '-')!s:>8} meas {row.get('measured_gib', '-')!s:>8} "
            f"err% {row.get('error_pct', '-')!s:>6} {row.get('error', '')[-200:]}",
            flush=True,
        )
        results = [r for r in results if r["name"] != name] + [row]
        summary = summarize(results)
        meta = {
            "gpu": torch.cuda.get_device_name(0),
            "date": dt.date.today().isoformat(),
            "versions": versions(),
            "summary": summary,
        }
        json.dump({"meta": meta, "runs": results}, open(args.out, "w"), indent=1)
    print("SUMMARY " + json.dumps(summarize(results)))


def summarize(results: list[dict]) -> dict:
    errs = sorted(abs(r["error_pct"]) for r in results if "error_pct" in r)
    if not errs:
        return {"n": 0}
    mid = len(errs) // 2
    median = errs[mid] if len(errs) % 2 else (errs[mid - 1] + errs[mid]) / 2
    return {"n": len(errs), "median_abs_error_pct": round(median, 1), "worst_abs_error_pct": errs[-1]}


def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for pkg in ("torch", "transformers", "peft", "accelerate", "deepspeed", "liger-kernel", "lmstack"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


if __name__ == "__main__":
    main()
