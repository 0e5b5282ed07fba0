"""Tokenization throughput of the data pipeline (not a test).

100k synthetic alpaca records of ~400 tokens each (prompt + answer, template included), the tiny
BPE tokenizer (`lmstack.tiny.build_tokenizer` on the shipped demo data), the qwen template,
`preprocessing_num_workers` as given (default 2). The tokenized cache is bypassed
(`overwrite_cache: true`, a temporary cache folder), so every run tokenizes everything.

    .venv/bin/python bench/tokenize_bench.py [--records 100000] [--workers 2] [--tokens 400]

Prints records/s and tokens/s and writes a JSON line to bench/results/tokenize_bench.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORDS = (
    "the model learns to answer questions about data training tokens language quickly and "
    "carefully while each example shows a short instruction with an input and a useful output "
    "number seven river mountain green blue paper window"
).split()


def synthetic_records(n: int, tokens: int, seed: int = 0) -> list[dict]:
    """Alpaca records whose encoded length averages about `tokens` with the tiny tokenizer
    (~2.6 tokens per word of this vocabulary, measured)."""
    rng = random.Random(seed)
    words_total = int(tokens / 2.6)
    out = []
    for i in range(n):
        total = max(8, int(rng.gauss(words_total, words_total * 0.25)))
        answer = total // 3
        out.append(
            {
                "instruction": f"Task {i}: " + " ".join(rng.choices(WORDS, k=total - answer - 10)),
                "input": " ".join(rng.choices(WORDS, k=10)),
                "output": " ".join(rng.choices(WORDS, k=answer)),
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=400, help="target mean tokens per record")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="lmstack-tokbench-"))
    os.environ["XDG_CACHE_HOME"] = str(tmp / "cache")
    from lmstack.config.load import build_config
    from lmstack.data.pipeline import build_datasets
    from lmstack.templates import get_template
    from lmstack.tiny import build_tokenizer, corpus_from_dir

    tokenizer = build_tokenizer(corpus_from_dir(REPO / "data"))
    template = get_template("qwen", tokenizer)
    records = synthetic_records(args.records, args.tokens)
    (tmp / "bench.json").write_text(json.dumps(records))
    (tmp / "dataset_info.json").write_text(json.dumps({"bench": {"file_name": "bench.json"}}))
    cfg = build_config(
        {
            "model_name_or_path": str(tmp),
            "output_dir": str(tmp / "out"),
            "template": "qwen",
            "dataset": "bench",
            "dataset_dir": str(tmp),
            "cutoff_len": 4096,
            "overwrite_cache": True,
            "preprocessing_num_workers": args.workers,
        }
    )

    def cpu() -> float:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    load_before = os.getloadavg()[0]
    start, cpu_start = time.perf_counter(), cpu()
    bundle = build_datasets(cfg, tokenizer, template)
    seconds, cpu_seconds = time.perf_counter() - start, cpu() - cpu_start
    tokens = int(bundle.train.lengths().sum())
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "records": len(bundle.train),
        "mean_tokens": round(tokens / len(bundle.train), 1),
        "workers": args.workers,
        "cpus": os.cpu_count(),
        "seconds": round(seconds, 2),
        "records_per_s": round(len(bundle.train) / seconds),
        "cpu_seconds": round(cpu_seconds, 2),
        "records_per_cpu_s": round(len(bundle.train) / cpu_seconds),
        "load_average_before": round(load_before, 2),
        "tokens_per_s": round(tokens / seconds),
        "python": sys.version.split()[0],
        "machine": platform.machine(),
    }
    print(
        f"{result['records']} records, mean {result['mean_tokens']} tokens, workers {args.workers}: "
        f"{seconds:.1f} s, {result['records_per_s']} records/s, {result['tokens_per_s']} tokens/s "
        f"(CPU {cpu_seconds:.1f} s = {result['records_per_cpu_s']} records per CPU-second; "
        f"load average before: {load_before:.1f})"
    )
    results = REPO / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    with (results / "tokenize_bench.jsonl").open("a") as fh:
        fh.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
