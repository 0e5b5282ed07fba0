"""DeepSpeed ZeRO-2 / ZeRO-3 / ZeRO-3+offload and FSDP through lmstack's real launch paths, LoRA and
full SFT of a Qwen2.5-0.5B-architecture model (random weights, bench/make_assets.py), >= 20 steps each;
peak memory and step time per run, one JSON line per run in bench/results/distributed.jsonl (and in
$OUT/distributed.jsonl when OUT is set).

    python3 bench/distributed_bench.py all --assets /tmp/assets [--steps 25] [--only z3_lora,fsdp_full]
    python3 bench/distributed_bench.py worker CFG.yaml RESULT.json     (internal: one rank's run)

Launch forms, as users run them (one GPU here; the same commands scale with --nproc_per_node):
  DeepSpeed: python -m torch.distributed.run --nproc_per_node 1 <worker> train cfg.yaml  (cfg has deepspeed:)
  FSDP:      python -m accelerate.commands.launch --config_file examples/accelerate/fsdp_config.yaml
             --num_processes 1 <worker> train cfg.yaml
The worker is `lmstack train` plus a callback that records CUDA-synchronised optimizer-step times
(median/mean after the first 5 steps; one step = 2 micro-batches of 4 x <= 1024 tokens) and peak
memory (bench code only). LoRA runs also check the saved adapter: every tensor non-empty, lora_B
trained. Needs deepspeed (+ hjson, pydantic) importable: PYTHONPATH=/tmp/site_lm:src as in
bench/run_bench.sh.
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

REPO = Path(__file__).resolve().parents[1]
WARMUP = 5
CASES = {
    "z2": dict(deepspeed="examples/deepspeed/ds_z2_config.json"),
    "z3": dict(deepspeed="examples/deepspeed/ds_z3_config.json"),
    "z3_offload": dict(deepspeed="examples/deepspeed/ds_z3_offload_config.json"),
    "fsdp": dict(accelerate="examples/accelerate/fsdp_config.yaml"),
}
METHODS = {
    "lora": dict(finetuning_type="lora", lora_target="all", lora_rank=8, lora_alpha=16, learning_rate=1e-4),
    "full": dict(finetuning_type="full", learning_rate=1e-5),
}


def base_cfg(assets: Path, steps: int) -> dict:
    return dict(
        model_name_or_path=str(assets / "qwen2.5-0.5b"),
        template="qwen",
        stage="sft",
        dataset="synth",
        dataset_dir=str(assets / "data"),
        cutoff_len=1024,
        max_samples=600,
        preprocessing_num_workers=8,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        overwrite_output_dir=True,
        bf16=True,
        gradient_checkpointing=True,
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )


def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("torch", "transformers", "peft", "accelerate", "deepspeed"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


# ---- worker: one rank of `lmstack train` with a measuring callback -----------------------------------
def worker(cfg_path: str, result_path: str) -> int:
    import torch
    from transformers import TrainerCallback

    import lmstack.train.common as common
    from lmstack.cli.main import main

    class Measure(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []
            self.t0 = 0.0

        def on_train_begin(self, args, state, control, **kw):
            torch.cuda.reset_peak_memory_stats()

        def on_step_begin(self, args, state, control, **kw):
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

        def on_train_end(self, args, state, control, **kw):
            if not state.is_world_process_zero:
                return
            steady = sorted(self.times[WARMUP:]) or sorted(self.times)
            Path(result_path).write_text(
                json.dumps(
                    {
                        "steps": state.global_step,
                        "step_time_s_median": steady[len(steady) // 2],
                        "step_time_s_mean": sum(steady) / len(steady),
                        "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
                        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3),
                        "first_loss": self.losses[0] if self.losses else None,
                        "last_loss": self.losses[-1] if self.losses else None,
                    }
                )
            )

    original = common.make_callbacks
    common.make_callbacks = lambda cfg: [*original(cfg), Measure()]
    return main(["train", cfg_path])


# ---- driver ------------------------------------------------------------------------------------------
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(case: dict, cfg_path: Path, result: Path) -> list[str]:
    me = str(Path(__file__).resolve())
    if "accelerate" in case:
        return [
            sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / case["accelerate"]),
            "--num_processes", "1", "--main_process_port", str(free_port()), me, "worker", str(cfg_path), str(result),
        ]  # fmt: skip
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(free_port()),
        me, "worker", str(cfg_path), str(result),
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


def run_one(name: str, case: dict, method: dict, assets: Path, steps: int, work: Path) -> dict:
    import yaml

    out = work / name
    cfg = {**base_cfg(assets, steps), **method, "output_dir": str(out)}
    if "deepspeed" in case:
        cfg["deepspeed"] = str(REPO / case["deepspeed"])
    cfg_path, result = work / f"{name}.yaml", work / f"{name}.result.json"
    cfg_path.write_text(yaml.safe_dump(cfg))
    result.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = command(case, cfg_path, result)
    start = time.monotonic()
    log = work / f"{name}.log"
    with log.open("w") as fh:
        proc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=600)
    row = {"name": name, "rc": proc.returncode, "wall_s": round(time.monotonic() - start, 1)}
    if result.is_file():
        row.update(json.loads(result.read_text()))
    if proc.returncode != 0:
        row["error_tail"] = log.read_text()[-1500:]
    elif method["finetuning_type"] == "lora":
        row.update(check_adapter(out))
    return row


def run_all(args: argparse.Namespace) -> int:
    import torch

    assets = Path(args.assets)
    if not (assets / "qwen2.5-0.5b" / "config.json").is_file():
        subprocess.run(
            [sys.executable, str(REPO / "bench/make_assets.py"), str(assets), "qwen2.5-0.5b"], check=True
        )
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "versions": versions(),
        "model": "qwen2.5-0.5b (random init)",
        "cutoff_len": 1024,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST"),
    }
    only = set(args.only.split(",")) if args.only else None
    results = [REPO / "bench/results/distributed.jsonl"]
    if os.environ.get("OUT"):
        results.append(Path(os.environ["OUT"]) / "distributed.jsonl")
    for path in results:
        path.parent.mkdir(parents=True, exist_ok=True)
    failed = 0
    for case_name, case in CASES.items():
        for method_name, method in METHODS.items():
            name = f"{case_name}_{method_name}"
            if only and name not in only:
                continue
            row = {**meta, **run_one(name, case, method, assets, args.steps, work)}
            failed += row["rc"] != 0
            line = json.dumps(row)
            print(line, flush=True)
            for path in results:
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
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--work", default="/tmp/dist_bench")
    p.add_argument("--only", help="comma-separated run names, e.g. z3_lora,fsdp_full")
    p = sub.add_parser("worker")
    p.add_argument("cfg")
    p.add_argument("result")
    args = parser.parse_args()
    if args.cmd == "worker":
        return worker(args.cfg, args.result)
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
