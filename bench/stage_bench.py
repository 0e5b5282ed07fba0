"""Stage benchmark on one GPU: SFT-LoRA, DPO-LoRA and the planner's `auto` fields, each through
lmstack's real `train` path in its own subprocess, one JSON line per run.

    python3 bench/stage_bench.py --assets ROOT [--runs sft_lora_0.5b,...] [--steps 20] [--budget 540]
        ROOT is built by `python3 bench/make_assets.py ROOT qwen2.5-0.5b,qwen2.5-7b`; lines are appended
        to bench/results/stages.jsonl (--results) and to $OUT/stages.jsonl when OUT is set; run logs
        in WORK/<name>.log (--work, default /tmp/stage_bench)
    python3 bench/stage_bench.py --child SPEC_JSON      (internal: one run)

Step time = wall time between consecutive optimizer-step ends (CUDA-synchronised; it includes data
loading and logging), median and mean after WARMUP steps; tokens/s = non-padding tokens the Trainer
counted (`num_input_tokens_seen`) over the same window. The preference set `synth_pref` pairs each
synth record's output (chosen) with another record's output (rejected).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchproc import result_from_log, run_killable  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WARMUP = 3  # optimizer steps left out of the step-time statistics
MIN_LEFT_S = 45  # a run is skipped when less of the overall budget is left
SMALL, BIG = "qwen2.5-0.5b", "qwen2.5-7b"

BASE = dict(
    template="qwen", do_train=True, dataset="synth", cutoff_len=1024, per_device_train_batch_size=4,
    gradient_accumulation_steps=1, learning_rate=1e-4, logging_steps=1, save_strategy="no",
    overwrite_output_dir=True, report_to="none", disable_tqdm=True, seed=42,
)  # fmt: skip
LORA = dict(finetuning_type="lora", lora_target="all", lora_rank=8, lora_alpha=16)
AUTO = dict(
    per_device_train_batch_size="auto", gradient_checkpointing="auto", deepspeed="auto",
    cutoff_len=2048, packing=True,
)  # fmt: skip


@dataclass
class Run:
    name: str
    arch: str
    method: str  # "lora" | "full"
    cfg: dict  # flat lmstack fields on top of BASE
    timeout: int  # seconds, further capped by what is left of --budget

    @property
    def stage(self) -> str:
        return self.cfg.get("stage", "sft")

    @property
    def auto(self) -> bool:
        return any(v == "auto" for v in self.cfg.values())


DPO = dict(stage="dpo", dataset="synth_pref", pref_beta=0.1, pref_loss="sigmoid")  # reference: adapter off
FULL = dict(finetuning_type="full", learning_rate=1e-5)
RUNS = [
    Run("sft_lora_0.5b", SMALL, "lora", {"stage": "sft", **LORA}, timeout=180),
    Run("dpo_lora_0.5b", SMALL, "lora", {**DPO, **LORA}, timeout=180),
    Run("auto_full_0.5b", SMALL, "full", {"stage": "sft", **FULL, **AUTO}, timeout=240),
    Run("auto_lora_7b", BIG, "lora", {"stage": "sft", **LORA, **AUTO}, timeout=300),
]


# ---- data ----------------------------------------------------------------------------------------
def prepare_data(assets: Path, data_dir: Path) -> None:
    """WORK/data: a copy of `synth` and the pairwise `synth_pref` built from it, both registered."""
    data_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(assets / "data" / "synth.json", data_dir / "synth.json")
    records = json.loads((data_dir / "synth.json").read_text())
    others = list(range(len(records)))
    random.Random(0).shuffle(others)
    pairs = []
    for i, rec in enumerate(records):
        j = others[i] if others[i] != i else (i + 1) % len(records)
        pairs.append({"instruction": rec["instruction"], "input": rec["input"],
                      "chosen": rec["output"], "rejected": records[j]["output"]})  # fmt: skip
    (data_dir / "synth_pref.json").write_text(json.dumps(pairs))
    info = json.loads((assets / "data" / "dataset_info.json").read_text())
    info["synth_pref"] = {
        "file_name": "synth_pref.json",
        "formatting": "alpaca",
        "ranking": True,
        "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen", "rejected": "rejected"},
    }
    (data_dir / "dataset_info.json").write_text(json.dumps(info, indent=2))


# ---- one run (subprocess) ------------------------------------------------------------------------
def child(spec: dict) -> None:
    """lmstack's real `train` with a recording callback; prints one `RESULT {json}` line at the end."""
    from lmstack.cli.main import setup_logging

    setup_logging()  # what `lmstack train` does first
    auto_log: list[str] = []

    class AutoLog(logging.Handler):
        def emit(self, record):
            auto_log.append(record.getMessage()[:400])

    logging.getLogger("lmstack.plan.auto").addHandler(AutoLog())

    import torch

    import lmstack.plan.auto as auto
    import lmstack.train.common as common
    from lmstack.train.run import train

    resolved: dict = {}
    resolve = auto.auto_values

    def recording_resolve(draft, gpu_memory_gib=None):
        chosen, message, fits = resolve(draft, gpu_memory_gib)
        resolved.update(chosen)
        auto_log.append(message)
        if chosen.get("deepspeed"):  # DeepSpeed wants a process group even on one GPU
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(spec["port"]))  # fmt: skip
        return chosen, message, fits

    auto.auto_values = recording_resolve  # RunPlan.resolve imports it at call time
    recorder = make_recorder(torch)
    make_callbacks = common.make_callbacks
    common.make_callbacks = lambda cfg: make_callbacks(cfg) + [recorder]  # the real stage, plus a recorder
    start = time.time()
    metrics = train(None, spec["config"])
    result = recorder.summary()
    result.update(wall_train_s=round(time.time() - start, 1), train_loss=metrics.get("train_loss"))
    if spec["auto"]:
        result["auto"] = {"resolved": resolved, "used": recorder.used, "planner": auto_log}
    print("RESULT " + json.dumps(result), flush=True)


def checkpointing(model) -> bool | None:
    """Whether the model recomputes activations (transformers >= 5.2x renamed the flag)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(model, name):
            return bool(getattr(model, name))
    return None


def make_recorder(torch):
    from transformers import TrainerCallback

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    class Recorder(TrainerCallback):
        """(step, time, tokens) at the start and at every optimizer-step end; every log dict."""

        def __init__(self):
            self.marks: list[tuple[int, float, int]] = []
            self.logs: list[dict] = []
            self.used: dict = {}

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            ds = args.deepspeed if isinstance(args.deepspeed, dict) else None
            self.used = {
                "per_device_train_batch_size": args.per_device_train_batch_size,
                "gradient_checkpointing": checkpointing(model),
                "deepspeed_zero_stage": ds["zero_optimization"].get("stage") if ds else None,
            }
            sync()
            self.marks.append((state.global_step, time.perf_counter(), state.num_input_tokens_seen))

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            self.marks.append((state.global_step, time.perf_counter(), state.num_input_tokens_seen))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs:
                self.logs.append(dict(logs))

        def summary(self) -> dict:
            times = [b[1] - a[1] for a, b in zip(self.marks, self.marks[1:], strict=False)][WARMUP:]
            window = self.marks[WARMUP:] if len(self.marks) > WARMUP + 1 else []
            tokens = window[-1][2] - window[0][2] if window else 0
            losses = [x["loss"] for x in self.logs if "loss" in x]
            last = {k: v for x in self.logs for k, v in x.items() if k.startswith("rewards/")}
            gib = lambda n: round(n / 2**30, 2)  # noqa: E731
            return {
                "steps": self.marks[-1][0] if self.marks else 0,
                "step_time_s_median": round(statistics.median(times), 4) if times else None,
                "step_time_s_mean": round(statistics.fmean(times), 4) if times else None,
                "tokens_per_sec": round(tokens / sum(times)) if tokens and times else None,
                "first_loss": losses[0] if losses else None,
                "last_loss": losses[-1] if losses else None,
                "dpo": last or None,
                "peak_alloc_gib": gib(torch.cuda.max_memory_allocated()) if cuda else None,
                "peak_reserved_gib": gib(torch.cuda.max_memory_reserved()) if cuda else None,
            }

    return Recorder()


# ---- orchestration -------------------------------------------------------------------------------
def child_env() -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")


PROBE = """
import json, importlib.metadata as m
out = {"versions": {}}
for n in ("torch", "transformers", "peft", "trl", "accelerate", "deepspeed", "datasets", "pydantic"):
    try: out["versions"][n] = m.version(n)
    except Exception: out["versions"][n] = None
import torch
out["cuda"] = torch.cuda.is_available()
out["gpu"] = torch.cuda.get_device_name(0) if out["cuda"] else "cpu"
print(json.dumps(out))
"""


def probe() -> dict:
    """Versions, CUDA and the GPU name, read in a subprocess so this process never holds a CUDA context."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], env=child_env(), capture_output=True, text=True, timeout=120
    )
    if proc.returncode != 0:
        sys.exit(f"environment probe failed:\n{proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    out["versions"]["lmstack_commit"] = git.stdout.strip() or None
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def execute(spec: dict, timeout: float, log_path: Path) -> tuple[int, dict | None]:
    """One child process in its own session (killed as a group on timeout); (rc, RESULT or None)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    rc = run_killable(cmd, child_env(), timeout, log_path)
    return rc, result_from_log(log_path)


def run_config(run: Run, args: argparse.Namespace, cuda: bool, work: Path) -> dict:
    return {
        **BASE,
        **run.cfg,
        "model_name_or_path": args.arch_override or str(Path(args.assets) / run.arch),
        "dataset_dir": str(work / "data"),
        "output_dir": str(work / "out" / run.name),
        "max_steps": args.steps,
        "bf16": cuda,
        "preprocessing_num_workers": min(8, os.cpu_count() or 1),
    }


def bench_one(run: Run, args: argparse.Namespace, env: dict, deadline: float, work: Path) -> dict:
    model_path = args.arch_override or str(Path(args.assets) / run.arch)
    line = {
        "name": run.name,
        "stage": run.stage,
        "method": run.method,
        "model": run.arch,
        "model_path": model_path,
    }
    left = deadline - time.time()
    if not (Path(model_path) / "config.json").is_file():
        return {**line, "status": "skipped: no asset"}
    if left < MIN_LEFT_S:
        return {**line, "status": "skipped", "reason": f"budget: {left:.0f}s left"}
    cfg = run_config(run, args, env["cuda"], work)
    spec = {"name": run.name, "config": cfg, "auto": run.auto, "port": free_port()}
    log_path = work / f"{run.name}.log"
    start = time.time()
    rc, result = execute(spec, min(run.timeout, left), log_path)
    line.update(status="ok" if rc == 0 and result else "failed", rc=rc, wall_s=round(time.time() - start, 1))
    line.update(result or {})
    log_text = log_path.read_text(errors="replace")
    if run.auto:
        line.setdefault("auto", {})["completed_without_oom"] = line["status"] == "ok"
    if line["status"] != "ok":
        line["oom"] = "out of memory" in log_text.lower()
        line["error_tail"] = log_text[-1500:]
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--assets", help="root built by bench/make_assets.py")
    ap.add_argument("--runs", default=",".join(r.name for r in RUNS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--work", default="/tmp/stage_bench")
    ap.add_argument("--arch-override", help="model dir used for every run instead of ROOT/<arch>")
    ap.add_argument("--budget", type=float, default=540, help="overall seconds")
    ap.add_argument("--results", default=str(REPO / "bench/results/stages.jsonl"))
    ap.add_argument("--run-id")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    if not args.assets:
        ap.error("--assets is required")
    chosen = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = sorted(set(chosen) - {r.name for r in RUNS})
    if unknown:
        ap.error(f"--runs: unknown {unknown}; known: {', '.join(r.name for r in RUNS)}")

    deadline = time.time() + args.budget
    run_id = args.run_id or dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    prepare_data(Path(args.assets), work / "data")
    env = probe()
    print("environment", json.dumps(env), flush=True)
    lines = []
    by_name = {r.name: r for r in RUNS}
    for run in [by_name[n] for n in chosen]:  # in the order given
        line = bench_one(run, args, env, deadline, work)
        line.update(gpu=env["gpu"], versions=env["versions"], run_id=run_id,
                    date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))  # fmt: skip
        lines.append(line)
        write_line(line, Path(args.results))
    print_summary(lines)


def write_line(line: dict, results: Path) -> None:
    text = json.dumps(line)
    print("LINE", text, flush=True)
    targets = [results]
    if os.environ.get("OUT"):  # what comes back from the GPU machine (the logs stay in --work)
        targets.append(Path(os.environ["OUT"]) / "stages.jsonl")
    for path in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as fh:
            fh.write(text + "\n")


def _cell(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def print_summary(lines: list[dict]) -> None:
    fmt = "{:<15} {:<17} {:>5} {:>8} {:>8} {:>7} {:>13}  {}"
    print("\n" + fmt.format("run", "status", "steps", "step_s", "tok/s", "alloc", "loss", "notes"))
    for r in lines:
        notes = ""
        if r.get("dpo"):
            dpo = r["dpo"]
            notes = f"acc {_cell(dpo.get('rewards/accuracies'))} margin {_cell(dpo.get('rewards/margins'))}"
        if r.get("auto", {}).get("used"):
            used = r["auto"]["used"]
            notes = (f"auto: batch {used['per_device_train_batch_size']}, checkpointing "
                     f"{used['gradient_checkpointing']}, ZeRO {used['deepspeed_zero_stage']}")  # fmt: skip
        loss = f"{_cell(r['first_loss'])}>{_cell(r.get('last_loss'))}" if r.get("first_loss") else "-"
        cells = [r.get(k) for k in ("steps", "step_time_s_median", "tokens_per_sec", "peak_alloc_gib")]
        print(fmt.format(r["name"], r["status"][:17], *map(_cell, cells), loss, notes))


if __name__ == "__main__":
    main()
