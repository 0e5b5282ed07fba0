"""GRPO step time on one GPU: lmstack (`stage: grpo`, its planned rollout engine) vs TRL's GRPOTrainer
with its defaults (model.generate rollouts, gradient checkpointing on), LoRA on random-init Qwen2.5
shapes, the same prompts and rewards, one JSON line per run.

    python3 bench/rl_bench.py --assets ROOT [--archs qwen2.5-1.5b,qwen2.5-7b] [--systems lmstack,trl]
                              [--steps 3] [--budget 300]
        ROOT is built by `python3 bench/make_assets.py ROOT qwen2.5-1.5b,qwen2.5-7b`; lines are appended
        to bench/results/rl.jsonl (--results) and to $OUT/rl.jsonl when OUT is set; run logs in
        WORK/<system>_<arch>.log (--work, default /tmp/rl_bench)
    python3 bench/rl_bench.py --child SPEC_JSON      (internal: one run)

Each step samples num_generations 8 answers of up to max_new_tokens 256 to one arithmetic prompt
(per_device_train_batch_size 8), scores them with lmstack's shipped `accuracy` and `length` rewards
(plain functions, handed to both trainers), and takes one LoRA step (r 8, alpha 16, every linear layer;
pref_beta / beta 0, TRL's default: no reference forward in either). Random weights rarely emit the end
token, so nearly every answer runs the full 256 tokens in both systems: the rollout cost is the
worst case, and the continuous batcher's gain from answers that end early does not show here.

step_s: median CUDA-synchronised wall time between optimizer-step ends after the first (warm-up: CUDA
graph capture, cache allocation) step. rollout_tokens_per_sec: answer tokens sampled over the time of
the rollout calls (`_generate_single_turn`, timed the same way in both: lmstack logs it as
rollout/tokens_per_sec; the TRL child wraps the method), mean over the same steps.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchproc import result_from_log, run_killable  # noqa: E402
from stage_bench import child_env, probe  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WARMUP = 1  # steps left out of the statistics
NUM_GENERATIONS, MAX_NEW = 8, 256
LORA = dict(lora_rank=8, lora_alpha=16)
TIMEOUTS = {"qwen2.5-0.5b": 90, "qwen2.5-1.5b": 110, "qwen2.5-7b": 140}  # seconds per run, load included
QUESTION = "What is {a} + {b}? Put the final answer in \\boxed{{}}."


def write_data(data_dir: Path, n: int = 256) -> None:
    """`rl_arith`: n addition prompts with their answers (alpaca: the output is the reference)."""
    rng = random.Random(0)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append({"instruction": QUESTION.format(a=a, b=b), "output": f"\\boxed{{{a + b}}}"})
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "rl_arith.json").write_text(json.dumps(rows))
    info = {"rl_arith": {"file_name": "rl_arith.json", "formatting": "alpaca"}}
    (data_dir / "dataset_info.json").write_text(json.dumps(info))


def lmstack_config(spec: dict) -> dict:
    return dict(
        model_name_or_path=spec["model"], stage="grpo", finetuning_type="lora", lora_target="all", **LORA,
        template="qwen", dataset="rl_arith", dataset_dir=spec["data"], cutoff_len=128,
        output_dir=spec["out"], overwrite_output_dir=True, max_steps=spec["steps"], logging_steps=1,
        per_device_train_batch_size=NUM_GENERATIONS, num_generations=NUM_GENERATIONS,
        max_new_tokens=MAX_NEW, temperature=1.0, top_p=1.0, top_k=0, pref_beta=0.0,
        reward_funcs="accuracy,length", learning_rate=1e-5, bf16=spec["cuda"], save_strategy="no",
        report_to="none", disable_tqdm=True, seed=42,
    )  # fmt: skip


def make_recorder(torch):
    from transformers import TrainerCallback

    cuda = torch.cuda.is_available()  # False only in a CPU smoke run of this script
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gib = (lambda n: round(n / 2**30, 2)) if cuda else (lambda n: None)

    class Recorder(TrainerCallback):
        def __init__(self):
            self.marks: list[float] = []
            self.logs: list[dict] = []

        def on_train_begin(self, args, state, control, **kwargs):
            sync()
            self.marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            self.marks.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs:
                self.logs.append(dict(logs))

        def summary(self) -> dict:
            steps = [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]
            rates = [x["rollout/tokens_per_sec"] for x in self.logs if "rollout/tokens_per_sec" in x]
            lengths = [x["completions/mean_length"] for x in self.logs if "completions/mean_length" in x]
            return {
                "steps": len(steps),
                "step_s": round(statistics.median(steps[WARMUP:]), 3) if len(steps) > WARMUP else None,
                "first_step_s": round(steps[0], 3) if steps else None,
                "rollout_tokens_per_sec": round(statistics.fmean(rates[WARMUP:]), 1)
                if len(rates) > WARMUP
                else None,
                "completion_mean_length": round(statistics.fmean(lengths), 1) if lengths else None,
                "peak_alloc_gib": gib(torch.cuda.max_memory_allocated() if cuda else 0),
                "peak_reserved_gib": gib(torch.cuda.max_memory_reserved() if cuda else 0),
                "losses": [x["loss"] for x in self.logs if "loss" in x],
            }

    return Recorder()


def child_lmstack(spec: dict) -> dict:
    import torch

    import lmstack.train.common as common
    from lmstack.cli.main import setup_logging
    from lmstack.train.run import train

    setup_logging()
    recorder = make_recorder(torch)
    make_callbacks = common.make_callbacks
    common.make_callbacks = lambda cfg: make_callbacks(cfg) + [recorder]  # the real stage, plus a recorder
    train(None, lmstack_config(spec))
    manifest = json.loads((Path(spec["out"]) / "run_manifest.json").read_text())
    decisions = manifest["plan"]["decisions"]
    return {**recorder.summary(), "plan_rl": decisions.get("rl"), "plan_decisions": decisions}


def child_trl(spec: dict) -> dict:
    """TRL's GRPOTrainer as its docs show it: GRPOConfig defaults but for the shared shape of the run."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from lmstack.templates.lookup import get_template
    from lmstack.train.rewards import accuracy, length_reward

    tok = AutoTokenizer.from_pretrained(spec["model"])
    template = get_template("qwen", tok)
    rows = json.loads((Path(spec["data"]) / "rl_arith.json").read_text())
    prompts = [
        {
            "prompt": tok.decode(
                template.encode_prompt(tok, [{"role": "user", "content": r["instruction"]}])
            ),
            "solution": r["output"],
        }
        for r in rows
    ]  # the same rendering lmstack's grpo stage hands TRL

    class TimedGRPO(GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, *rest, **kwargs):
            start = time.perf_counter()
            out = super()._generate_single_turn(prompt_ids, *rest, **kwargs)
            seconds = time.perf_counter() - start
            self._metrics["train"]["rollout/tokens_per_sec"].append(sum(len(c) for c in out[0]) / seconds)
            return out

    cuda = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(
        spec["model"], dtype=torch.bfloat16 if cuda else torch.float32
    )
    args = GRPOConfig(
        output_dir=spec["out"], max_steps=spec["steps"], logging_steps=1, per_device_train_batch_size=NUM_GENERATIONS,
        num_generations=NUM_GENERATIONS, max_completion_length=MAX_NEW, learning_rate=1e-5, bf16=cuda,
        save_strategy="no", report_to="none", disable_tqdm=True, seed=42, temperature=1.0, top_p=1.0,
    )  # fmt: skip
    recorder = make_recorder(torch)
    trainer = TimedGRPO(
        model=model,
        reward_funcs=[accuracy, length_reward(MAX_NEW)],
        args=args,
        train_dataset=Dataset.from_list(prompts),
        processing_class=tok,
        peft_config=LoraConfig(
            r=LORA["lora_rank"], lora_alpha=LORA["lora_alpha"], target_modules="all-linear"
        ),
        callbacks=[recorder],
    )
    trainer.train()
    return {**recorder.summary(), "trl_defaults": {"gradient_checkpointing": args.gradient_checkpointing,
                                                  "beta": args.beta, "loss_type": args.loss_type}}  # fmt: skip


def child(spec: dict) -> None:
    run = child_lmstack if spec["system"] == "lmstack" else child_trl
    print("RESULT " + json.dumps(run(spec)), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--assets")
    ap.add_argument("--archs", default="qwen2.5-1.5b,qwen2.5-7b")
    ap.add_argument("--systems", default="lmstack,trl")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--work", default="/tmp/rl_bench")
    ap.add_argument("--budget", type=float, default=300, help="overall seconds")
    ap.add_argument("--results", default=str(REPO / "bench/results/rl.jsonl"))
    ap.add_argument("--run-id")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    if not args.assets:
        ap.error("--assets is required")
    deadline = time.time() + args.budget
    run_id = args.run_id or dt.datetime.now(dt.UTC).strftime("rl_%Y%m%dT%H%M%SZ")
    work = Path(args.work)
    write_data(work / "data")
    env = probe()
    for arch in [a.strip() for a in args.archs.split(",") if a.strip()]:
        for system in [s.strip() for s in args.systems.split(",") if s.strip()]:
            line = bench_one(system, arch, args, work, deadline, env)
            line.update(run_id=run_id, gpu=env["gpu"], versions=env["versions"],
                        date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))  # fmt: skip
            write_line(line, Path(args.results))


def bench_one(
    system: str, arch: str, args: argparse.Namespace, work: Path, deadline: float, env: dict
) -> dict:
    model = Path(args.assets) / arch
    line = {"system": system, "model": arch, "method": "lora", "num_generations": NUM_GENERATIONS,
            "max_new_tokens": MAX_NEW}  # fmt: skip
    left = deadline - time.time()
    if not (model / "config.json").is_file():
        return {**line, "status": "skipped: no asset"}
    if left < 30:
        return {**line, "status": "skipped", "reason": f"budget: {left:.0f}s left"}
    spec = {"system": system, "model": str(model), "data": str(work / "data"),
            "out": str(work / "out" / f"{system}_{arch}"), "steps": args.steps, "cuda": env["cuda"]}  # fmt: skip
    log = work / f"{system}_{arch}.log"
    start = time.time()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    rc = run_killable(cmd, child_env(), min(TIMEOUTS.get(arch, 150), left), log)
    result = result_from_log(log)
    line.update(status="ok" if rc == 0 and result else "failed", rc=rc, wall_s=round(time.time() - start, 1))
    line.update(result or {})
    if line["status"] != "ok":
        line["error_tail"] = log.read_text(errors="replace")[-1500:]
    return line


def write_line(line: dict, results: Path) -> None:
    text = json.dumps(line)
    print("LINE", text, flush=True)
    targets = [results] + ([Path(os.environ["OUT"]) / "rl.jsonl"] if os.environ.get("OUT") else [])
    for path in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
