"""Serving benchmark: starts `lmstack api` on a YAML, fires concurrent chat requests with the official
`openai` client (async, streamed so time to first token is measured too) and prints one JSON line:
requests/s, p50/p99 latency, p50/p99 time to first token, completion tokens/s.

    python bench/serve_bench.py CFG.yaml [key=value ...] [--requests 32] [--concurrency 32]
        [--max-tokens 128] [--api-arg=--max-batch=32] [--results bench/results/serve.jsonl] [--name NAME]
        [--log server.log]

`key=value` overrides go to `lmstack api` (e.g. `infer_backend=vllm`, `max_new_tokens=512`); the
server's `--max-tokens-limit` is set to `--max-tokens`. Greedy unless the YAML samples. The server
runs in its own session and is killed with its children at the end (or after `--timeout` seconds).
CPU check with the tiny model: `python bench/serve_bench.py tiny.yaml --requests 4 --concurrency 4`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

PROMPTS = [
    "Explain how a transformer language model generates text, step by step.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between TCP and UDP? Give examples of when to use each.",
    "Summarize the causes and consequences of the French Revolution.",
    "Give me a recipe for a vegetarian lasagna with a list of ingredients.",
    "How does photosynthesis work? Explain it to a ten-year-old.",
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
    "List ten ideas for a weekend trip in the mountains and what to pack for each.",
]


def start_server(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable, "-m", "lmstack.cli.main", "api", args.config, *args.overrides,
        "--port", "0", "--model-name", "bench", "--max-tokens-limit", str(args.max_tokens),
        "--max-queue", str(max(args.requests, 16)), *args.api_arg,
    ]  # fmt: skip
    out = log.open("w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline and proc.poll() is None:
        match = re.search(r"serving 'bench' at (http://\S+/v1)", log.read_text(errors="replace"))
        if match:
            return proc, match.group(1)
        time.sleep(0.5)
    stop_server(proc)
    raise SystemExit(f"lmstack api did not start; its log:\n{log.read_text(errors='replace')[-4000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def one(client, prompt: str, max_tokens: int) -> dict:
    start = time.monotonic()
    first, usage = None, None
    stream = await client.chat.completions.create(
        model="bench",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.monotonic() - start
        if chunk.usage is not None:
            usage = chunk.usage
    return {
        "latency": time.monotonic() - start,
        "ttft": first if first is not None else time.monotonic() - start,
        "completion_tokens": usage.completion_tokens if usage else 0,
    }


async def fire(url: str, n: int, concurrency: int, max_tokens: int) -> tuple[list[dict], float]:
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="bench", max_retries=0, timeout=3600)
    await one(client, PROMPTS[0], min(8, max_tokens))  # warm-up (kernels, caches)
    gate = asyncio.Semaphore(concurrency)

    async def bounded(i: int) -> dict:
        async with gate:
            return await one(client, PROMPTS[i % len(PROMPTS)], max_tokens)

    start = time.monotonic()
    results = await asyncio.gather(*(bounded(i) for i in range(n)))
    wall = time.monotonic() - start
    await client.close()
    return list(results), wall


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def summary(args: argparse.Namespace, results: list[dict], wall: float) -> dict:
    latencies = [r["latency"] for r in results]
    ttfts = [r["ttft"] for r in results]
    tokens = sum(r["completion_tokens"] for r in results)
    backend = next((o.split("=", 1)[1] for o in args.overrides if o.startswith("infer_backend=")), None)
    line = {
        "name": args.name or Path(args.config).stem,
        "config": args.config,
        "overrides": args.overrides,
        "api_args": args.api_arg,
        "infer_backend": backend or "from the YAML (huggingface unless set)",
        "requests": len(results),
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(results) / wall, 3),
        "p50_latency_s": round(percentile(latencies, 50), 3),
        "p99_latency_s": round(percentile(latencies, 99), 3),
        "p50_ttft_s": round(percentile(ttfts, 50), 3),
        "p99_ttft_s": round(percentile(ttfts, 99), 3),
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1),
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    try:
        import torch

        line["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:
        line["gpu"] = "unknown"
    return line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key=value overrides for lmstack api")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--api-arg", action="append", default=[], help="extra lmstack api flag, e.g. --api-arg=--max-batch=32"
    )
    p.add_argument("--results", help="append the JSON line to this file too")
    p.add_argument("--name")
    p.add_argument("--log", help="keep the server's log here (default: a temporary file)")
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--timeout", type=float, default=1800, help="seconds for the requests")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(args.log) if args.log else Path(tmp) / "server.log"
        proc, url = start_server(args, log)
        try:
            results, wall = asyncio.run(
                asyncio.wait_for(fire(url, args.requests, args.concurrency, args.max_tokens), args.timeout)
            )
        finally:
            stop_server(proc)
    line = json.dumps(summary(args, results, wall))
    print(line, flush=True)
    if args.results:
        with open(args.results, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
