"""A small real RL task on one GPU: does GRPO raise the `accuracy` reward? Random weights cannot learn
arithmetic in 100 RL steps (almost every reward is 0, so every group's advantage is 0 and nothing
moves), so the 0.5B-shape model is first warm-started by SFT on the task, briefly enough that it writes
the answer format and gets some sums right; GRPO then trains 100 steps on the same prompts with
`reward_funcs: accuracy`, and the line records the accuracy per step (sampled at temperature 1) and its
mean over the first and the last 10 steps.

    python3 bench/rl_task.py --assets ROOT [--sft-steps 60] [--grpo-steps 100] [--budget 420]
        ROOT/qwen2.5-0.5b from `python3 bench/make_assets.py ROOT qwen2.5-0.5b`; the line goes to
        bench/results/rl_task.jsonl (--results) and $OUT/rl_task.jsonl; logs in WORK/{sft,grpo}.log

Both stages run through `lmstack train` (the real CLI, one subprocess each): the task is one-digit
addition, "What is a + b?" -> "\\boxed{a+b}", all 100 pairs (a held-out check is not the point here:
the question is whether the RL signal moves the policy). `--sft-steps` sets how far the warm start goes:
60 steps (about 19 passes over the 100 pairs at batch 32) is meant to leave the sampled accuracy well
between 0 and 1; if `accuracy_first10` comes back near 1 (nothing left to learn) lower it, near 0 raise it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchproc import run_killable  # noqa: E402
from stage_bench import child_env, probe  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def write_data(data_dir: Path) -> None:
    rows = [
        {"instruction": f"What is {a} + {b}?", "output": f"\\boxed{{{a + b}}}"}
        for a in range(10)
        for b in range(10)
    ]
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "add.json").write_text(json.dumps(rows))
    (data_dir / "dataset_info.json").write_text(json.dumps({"add": {"file_name": "add.json"}}))


def configs(model: str, work: Path, args: argparse.Namespace, cuda: bool) -> tuple[dict, dict]:
    common = dict(template="qwen", dataset="add", dataset_dir=str(work / "data"), cutoff_len=64,
                  logging_steps=1, save_strategy="no", overwrite_output_dir=True, report_to="none",
                  disable_tqdm=True, seed=42, bf16=cuda)  # fmt: skip
    sft = dict(common, model_name_or_path=model, stage="sft", finetuning_type="full", learning_rate=3e-4,
               lr_scheduler_type="cosine", warmup_ratio=0.05, per_device_train_batch_size=32,
               max_steps=args.sft_steps, output_dir=str(work / "sft"))  # fmt: skip
    grpo = dict(common, model_name_or_path=str(work / "sft"), stage="grpo", finetuning_type="lora",
                lora_target="all", lora_rank=16, lora_alpha=32, learning_rate=5e-5,
                per_device_train_batch_size=32, num_generations=8, max_new_tokens=12, temperature=1.0,
                top_p=1.0, top_k=0, pref_beta=0.0, reward_funcs="accuracy", max_steps=args.grpo_steps,
                output_dir=str(work / "grpo"))  # fmt: skip
    return sft, grpo


def run_stage(name: str, cfg: dict, work: Path, timeout: float) -> int:
    path = work / f"{name}.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    cmd = [sys.executable, "-m", "lmstack.cli", "train", str(path)]
    return run_killable(cmd, child_env(), timeout, work / f"{name}.log")


def log_lines(out: Path) -> list[dict]:
    path = out / "trainer_log.jsonl"
    if not path.is_file():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--assets", required=True)
    ap.add_argument("--arch", default="qwen2.5-0.5b")
    ap.add_argument("--sft-steps", type=int, default=60)
    ap.add_argument("--grpo-steps", type=int, default=100)
    ap.add_argument("--work", default="/tmp/rl_task")
    ap.add_argument("--budget", type=float, default=420)
    ap.add_argument("--results", default=str(REPO / "bench/results/rl_task.jsonl"))
    args = ap.parse_args()
    deadline = time.time() + args.budget
    work = Path(args.work)
    write_data(work / "data")
    env = probe()
    sft, grpo = configs(str(Path(args.assets) / args.arch), work, args, env["cuda"])
    line: dict = {"model": args.arch, "task": "one-digit addition", "sft_steps": args.sft_steps,
                  "grpo_steps": args.grpo_steps, "sft": sft, "grpo": grpo}  # fmt: skip
    start = time.time()
    line["sft_rc"] = run_stage("sft", sft, work, deadline - time.time())
    sft_losses = [x["loss"] for x in log_lines(work / "sft") if "loss" in x]
    line["sft_loss_first_last"] = [sft_losses[0], sft_losses[-1]] if sft_losses else None
    line["sft_s"] = round(time.time() - start, 1)
    if line["sft_rc"] == 0:
        start = time.time()
        line["grpo_rc"] = run_stage("grpo", grpo, work, deadline - time.time())
        line["grpo_s"] = round(time.time() - start, 1)
    acc = [x["rewards/accuracy/mean"] for x in log_lines(work / "grpo") if "rewards/accuracy/mean" in x]
    line["accuracy_per_step"] = [round(a, 4) for a in acc]
    if len(acc) >= 20:
        first, last = statistics.fmean(acc[:10]), statistics.fmean(acc[-10:])
        line.update(accuracy_first10=round(first, 4), accuracy_last10=round(last, 4), rose=last > first)
    line.update(
        gpu=env["gpu"], versions=env["versions"], date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    )
    text = json.dumps(line)
    print("LINE", text, flush=True)
    print(f"accuracy first 10 steps {line.get('accuracy_first10')}, last 10 {line.get('accuracy_last10')}")
    for path in [Path(args.results)] + (
        [Path(os.environ["OUT"]) / "rl_task.jsonl"] if os.environ.get("OUT") else []
    ):
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
