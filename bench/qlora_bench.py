"""QLoRA memory benchmark: LoRA SFT of a Qwen2.5-7B-architecture model (random weights) with a bf16 base,
a 4-bit NF4 base and an 8-bit base, through lmstack's real `train` path; one subprocess per run so each
peak is its own. One JSON line per run -> bench/results/qlora.jsonl (and $OUT/qlora.jsonl when OUT is set).

    python3 bench/make_assets.py /tmp/assets qwen2.5-7b        # tokenizer, synthetic data, the 7B model
    python3 bench/qlora_bench.py --assets /tmp/assets [--runs bf16,nf4,int8] [--steps 20]
    python3 bench/qlora_bench.py one NAME CONFIG_JSON          # internal: one run, prints RESULT {...}

Recorded per run: weights memory right after loading (torch.cuda.memory_allocated), the bytes per
parameter of the quantized linear layers and of the whole model, peak allocated/reserved memory over
training, steps, runtime, tokens/s, first/last loss, GPU, versions, date.
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
ARCH = "qwen2.5-7b"
COMMON = dict(
    stage="sft", do_train=True, template="qwen", dataset="synth", cutoff_len=1024, max_samples=400,
    finetuning_type="lora", lora_target="all", lora_rank=8, lora_alpha=16, bf16=True,
    per_device_train_batch_size=4, gradient_accumulation_steps=1, gradient_checkpointing=True,
    learning_rate=1e-4, logging_steps=5, save_strategy="no", report_to="none", disable_tqdm=True,
    overwrite_output_dir=True, flash_attn="sdpa", seed=42,
)  # fmt: skip
RUNS = {
    "bf16": {},
    "nf4": {"quantization_bit": 4, "quantization_type": "nf4", "double_quantization": True},
    "int8": {"quantization_bit": 8},
}


def one(name: str, cfg: dict) -> dict:
    """Runs in the child: train, measuring the loaded weights and the training peak."""
    import torch

    import lmstack.train.sft as sft
    from lmstack.train.run import train

    cuda = torch.cuda.is_available()  # CPU: a smoke test of this script with a tiny model, no memory numbers
    seen: dict = {}
    real_load = sft.load_model

    def measured_load(*args, **kwargs):
        model = real_load(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        seen.update(weights_bytes=torch.cuda.memory_allocated() if cuda else 0, **_param_bytes(model))
        return model

    sft.load_model = measured_load
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.time()
    metrics = train(None, cfg)
    if cuda:
        torch.cuda.synchronize()
    log = [json.loads(x) for x in (Path(cfg["output_dir"]) / "trainer_log.jsonl").read_text().splitlines()]
    curve = [r["loss"] for r in log if "loss" in r]
    gib = 2**30
    return {
        "name": name,
        "arch": ARCH,
        "quantization_bit": cfg.get("quantization_bit"),
        "quantization_type": cfg.get("quantization_type") if cfg.get("quantization_bit") == 4 else None,
        "weights_gib": round(seen["weights_bytes"] / gib, 3),
        "params": seen["params"],
        "bytes_per_param_model": round(seen["weights_bytes"] / seen["params"], 3),
        "bytes_per_param_quantized_linear": seen["linear_bytes_per_param"],
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / gib, 3) if cuda else None,
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / gib, 3) if cuda else None,
        "steps": max((r["current_steps"] for r in log), default=0),
        "train_runtime_s": metrics.get("train_runtime"),
        "tokens_per_s": round(
            metrics.get("num_input_tokens_seen", 0) / max(metrics.get("train_runtime", 1), 1e-9), 1
        ),
        "loss_first": curve[0] if curve else None,
        "loss_last": curve[-1] if curve else None,
        "wall_s": round(time.time() - start, 1),
        "micro_batch": cfg["per_device_train_batch_size"],
        "cutoff_len": cfg["cutoff_len"],
        "gradient_checkpointing": cfg["gradient_checkpointing"],
    }


def _param_bytes(model) -> dict:
    """Parameter count (quantized weights counted at their logical size) and the stored bytes per
    parameter of the bitsandbytes linear layers."""
    total = lin_params = lin_bytes = 0
    for module in model.modules():
        kind = type(module).__name__
        own = list(module.named_parameters(recurse=False))
        if kind in ("Linear4bit", "Linear8bitLt"):
            weight = module.weight
            logical = module.in_features * module.out_features
            stored = weight.numel() * weight.element_size()
            state = getattr(weight, "quant_state", None)
            if state is not None:  # 4-bit: absmax (and nested absmax with double quantization)
                stored += state.absmax.numel() * state.absmax.element_size()
                if getattr(state, "state2", None) is not None:
                    stored += state.state2.absmax.numel() * state.state2.absmax.element_size()
            scb = getattr(weight, "SCB", None)
            if scb is not None:  # 8-bit: one scale per row
                stored += scb.numel() * scb.element_size()
            lin_params += logical
            lin_bytes += stored
            total += logical + sum(p.numel() for n, p in own if n != "weight")
        else:
            total += sum(p.numel() for _, p in own)
    return {
        "params": total,
        "linear_bytes_per_param": round(lin_bytes / lin_params, 4) if lin_params else None,
    }


def env_info() -> dict:
    import torch
    import transformers

    info = {
        "date": dt.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    for pkg in ("peft", "bitsandbytes", "accelerate"):
        try:
            info[pkg] = __import__(pkg).__version__
        except ImportError:
            info[pkg] = None
    return info


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "one":
        result = one(sys.argv[2], json.loads(sys.argv[3]))
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--assets", default="/tmp/assets")
    parser.add_argument("--runs", default="bf16,nf4,int8")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--timeout", type=int, default=300, help="seconds per run")
    args = parser.parse_args()
    model = Path(args.assets) / ARCH
    if not (model / "config.json").is_file():
        print(f"no model at {model}; run: python3 bench/make_assets.py {args.assets} {ARCH}", file=sys.stderr)
        return 2
    info = env_info()
    outputs = [REPO / "bench" / "results" / "qlora.jsonl"]
    if os.environ.get("OUT"):
        outputs.append(Path(os.environ["OUT"]) / "qlora.jsonl")
    failed = 0
    for name in args.runs.split(","):
        cfg = {
            **COMMON,
            **RUNS[name],
            "model_name_or_path": str(model),
            "dataset_dir": str(Path(args.assets) / "data"),
            "output_dir": f"/tmp/qlora_bench/{name}",
            "max_steps": args.steps,
        }
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "one", name, json.dumps(cfg)],
                capture_output=True, text=True, timeout=args.timeout, env=env,
            )  # fmt: skip
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            record = json.loads(lines[-1][7:]) if lines else {"name": name, "error": proc.stderr[-2000:]}
        except subprocess.TimeoutExpired:
            record = {"name": name, "error": f"timed out after {args.timeout}s"}
        record.update(info)
        failed += "error" in record
        print(json.dumps(record), flush=True)
        for path in outputs:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as fh:
                fh.write(json.dumps(record) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
