"""Host overhead of the continuous batcher (`infer/batching.py`), without HTTP: submits B greedy
sequences at once to a `Scheduler` on a model (the tiny model: its compute is negligible, so what is
measured is the batcher's own per-step work) and prints one JSON line per batch size: decode steps/s,
milliseconds per decode forward, the prefills' share of the wall time, and host microseconds per row
per step (wall minus all forward time, over steps x rows).

    python bench/batcher_bench.py MODEL_DIR [--batch 1 8 32] [--max-tokens 128] [--repeat 3]
        [--stop STRING] [--results bench/results/serve_cpu.jsonl] [--name NAME]

Stop tokens are off (every sequence runs `--max-tokens` steps); `--stop` adds a stop string that
never appears, so its hold-back and search are measured too. The best of `--repeat` runs is kept.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import time
from datetime import UTC, datetime


def load(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def forward_timer(model) -> list[float]:
    """Accumulates the seconds spent inside model forwards: [decode, prefill]."""
    spent, started = [0.0, 0.0], [0.0]

    def before(module, args, kwargs):
        started[0] = time.perf_counter()

    def after(module, args, kwargs, output):
        spent[kwargs["input_ids"].shape[1] > 1] += time.perf_counter() - started[0]

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True)
    return spent


def one_run(model, tokenizer, spent, batch: int, max_tokens: int, stop: tuple[str, ...]) -> dict:
    from lmstack.infer.batching import Scheduler
    from lmstack.infer.sampling import Generation, Sampling

    prompts = [tokenizer(f"Hello number {i}, tell me a story.")["input_ids"] for i in range(batch)]
    scheduler = Scheduler(model, tokenizer, stop_ids=[], max_batch=batch)
    done: queue.Queue = queue.Queue()
    pieces = [0]

    def sink(event) -> None:
        if isinstance(event, Generation) or isinstance(event, Exception):
            done.put(event)
        else:
            pieces[0] += 1

    sampling = Sampling(max_tokens=max_tokens, stop=stop)
    decode0, prefill0 = spent
    start = time.perf_counter()
    for ids in prompts:
        scheduler.submit(ids, sampling, sink, threading.Event())
    results = [done.get(timeout=600) for _ in prompts]
    wall = time.perf_counter() - start
    scheduler.close()
    bad = [r for r in results if not isinstance(r, Generation)]
    if bad:
        raise SystemExit(f"generation failed: {bad[0]!r}")
    steps, decode, prefill = scheduler.steps, spent[0] - decode0, spent[1] - prefill0
    return {
        "batch": batch,
        "steps": steps,
        "wall_s": round(wall, 4),
        "steps_per_s": round(steps / wall, 1),
        "tokens_per_s": round(sum(r.completion_tokens for r in results) / wall, 1),
        "decode_forward_ms": round(decode / max(1, steps) * 1e3, 3),
        "prefill_share": round(prefill / wall, 3),
        "host_us_per_row_step": round((wall - decode - prefill) / max(1, steps * batch) * 1e6, 1),
        "pieces": pieces[0],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--results", help="append the JSON lines to this file too")
    p.add_argument("--name", default="batcher_bench")
    args = p.parse_args(argv)
    model, tokenizer = load(args.model_dir)
    spent = forward_timer(model)
    one_run(model, tokenizer, spent, 2, 8, tuple(args.stop))  # warm-up
    lines = []
    for batch in args.batch:
        runs = [
            one_run(model, tokenizer, spent, batch, args.max_tokens, tuple(args.stop))
            for _ in range(args.repeat)
        ]
        best = max(runs, key=lambda r: r["steps_per_s"])
        line = {
            "name": args.name,
            "model": args.model_dir,
            "max_tokens": args.max_tokens,
            "stop": args.stop,
            **best,
            "gpu": "cpu",
            "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        lines.append(json.dumps(line))
        print(lines[-1], flush=True)
    if args.results:
        with open(args.results, "a") as f:
            f.write("".join(x + "\n" for x in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
