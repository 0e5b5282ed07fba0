"""Host overhead of the continuous batcher (`infer/batching.py`), without HTTP: submits B greedy
sequences at once to a `Scheduler` on a model (the tiny model: its compute is negligible, so what is
measured is the batcher's own per-step work) and prints one JSON line per batch size: decode steps/s,
milliseconds per decode forward, the prefills' share of the wall time, and host microseconds per row
per step (wall minus all forward time, over steps x rows).

    python bench/batcher_bench.py MODEL_DIR [--batch 1 8 32] [--max-tokens 128] [--repeat 3]
        [--stop STRING] [--loop] [--results bench/results/serve_cpu.jsonl] [--name NAME]

Stop tokens are off (every sequence runs `--max-tokens` steps); `--stop` adds a stop string that
never appears, so its hold-back and search are measured too. `--loop`: the events go through the
server's `Runs` into an asyncio loop in the main thread, which JSON-encodes one SSE chunk per
coalesced piece (the serving path without HTTP: batcher vs event loop under one GIL). The best of
`--repeat` runs is kept. On a GPU the model runs in bfloat16 on cuda:0 and the forward timer
synchronizes (so decode_forward_ms is the forward's real time). On CPU torch runs one thread (on a
small shared machine more threads make every op wait on the others).
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

    if torch.cuda.is_available():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda:0")
    else:
        torch.set_num_threads(1)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
    return model.eval(), AutoTokenizer.from_pretrained(model_dir)


def forward_timer(model) -> list[float]:
    """Accumulates the seconds spent inside model forwards: [decode, prefill]."""
    import torch

    spent, started = [0.0, 0.0], [0.0]
    sync = torch.cuda.synchronize if model.device.type == "cuda" else lambda: None

    def before(module, args, kwargs):
        sync()
        started[0] = time.perf_counter()

    def after(module, args, kwargs, output):
        sync()
        spent[kwargs["input_ids"].shape[1] > 1] += time.perf_counter() - started[0]

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True)
    return spent


def direct(scheduler, prompts: list, sampling) -> tuple[list, int]:
    """Sinks called in the batcher's thread; (results, pieces)."""
    from lmstack.infer.sampling import Generation

    done: queue.Queue = queue.Queue()
    pieces = [0]

    def sink(event) -> None:
        if isinstance(event, Generation) or isinstance(event, Exception):
            done.put(event)
        else:
            pieces[0] += 1

    for ids in prompts:
        scheduler.submit(ids, sampling, sink, threading.Event())
    return [done.get(timeout=600) for _ in prompts], pieces[0]


def through_loop(scheduler, prompts: list, sampling) -> tuple[list, int]:
    """The server's hand-off: `Runs` per request, an asyncio loop encoding SSE chunks."""
    import asyncio

    from lmstack.infer.sampling import Generation, Piece
    from lmstack.infer.server import Runs

    async def stream(ids) -> tuple[Generation, int]:
        runs, chunks, result = Runs(scheduler, [(ids, sampling)], threading.Event()), 0, None
        async for batch in runs.batches():
            for _, event in batch:
                if isinstance(event, Piece):
                    json.dumps({"choices": [{"index": 0, "delta": {"content": event.text}}]})
                    chunks += 1
                else:
                    result = event
        return result, chunks

    async def main():
        return await asyncio.gather(*(stream(ids) for ids in prompts))

    out = asyncio.run(main())
    return [r for r, _ in out], sum(n for _, n in out)


def one_run(model, tokenizer, spent, batch: int, max_tokens: int, stop: tuple, loop: bool) -> dict:
    from lmstack.infer.batching import Scheduler
    from lmstack.infer.sampling import Generation, Sampling

    prompts = [tokenizer(f"Hello number {i}, tell me a story.")["input_ids"] for i in range(batch)]
    scheduler = Scheduler(model, tokenizer, stop_ids=[], max_batch=batch)
    sampling = Sampling(max_tokens=max_tokens, stop=stop)
    decode0, prefill0 = spent
    start = time.perf_counter()
    results, pieces = (through_loop if loop else direct)(scheduler, prompts, sampling)
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
        "pieces": pieces,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--loop", action="store_true", help="through the server's Runs and an asyncio loop")
    p.add_argument("--results", help="append the JSON lines to this file too")
    p.add_argument("--name", default="batcher_bench")
    args = p.parse_args(argv)
    import torch

    model, tokenizer = load(args.model_dir)
    spent = forward_timer(model)
    stop = tuple(args.stop)
    one_run(model, tokenizer, spent, 2, 8, stop, args.loop)  # warm-up
    lines = []
    for batch in args.batch:
        runs = [
            one_run(model, tokenizer, spent, batch, args.max_tokens, stop, args.loop)
            for _ in range(args.repeat)
        ]
        best = max(runs, key=lambda r: r["steps_per_s"])
        line = {
            "name": args.name,
            "model": args.model_dir,
            "max_tokens": args.max_tokens,
            "stop": args.stop,
            "path": "asyncio loop via Runs" if args.loop else "sinks in the batcher thread",
            **best,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
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
