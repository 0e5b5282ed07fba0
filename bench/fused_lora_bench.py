"""Fused LoRA micro-benchmark: PEFT's LoRA Linear vs lmstack's fused one (models/fused_lora.py), forward +
backward of a Qwen2.5-0.5B-like layer stack (hidden 896, intermediate 4864, q/k/v with bias, GQA 14/2
heads of 64, LoRA r8 alpha16 on all seven projections, bf16 base and adapters as lmstack trains them),
32 x 2048 tokens, timed with CUDA events. Not run in CI (needs a CUDA GPU).

    PYTHONPATH=src python3 bench/fused_lora_bench.py [--layers 4] [--tokens 65536] [--rank 8] [--out FILE]

Prints one table: per projection (one LoRA Linear alone) and for the whole stack, the median ms of a
forward+backward step with PEFT and fused, the speed-up, and peak allocated memory; plus the max
difference of the stack's output and adapter gradients between the two (bf16 rounding). With --out,
one JSON line (the table, GPU, versions, date) is appended to FILE (e.g. bench/results/fused_lora.jsonl).
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

HIDDEN, INTER, KV = 896, 4864, 128  # Qwen2.5-0.5B: 14 query heads, 2 key/value heads, head dim 64
PROJ = {  # name: (in, out, bias)
    "q_proj": (HIDDEN, HIDDEN, True),
    "k_proj": (HIDDEN, KV, True),
    "v_proj": (HIDDEN, KV, True),
    "o_proj": (HIDDEN, HIDDEN, False),
    "gate_proj": (HIDDEN, INTER, False),
    "up_proj": (HIDDEN, INTER, False),
    "down_proj": (INTER, HIDDEN, False),
}


class Layer(nn.Module):
    """The seven projections of a decoder layer in their data flow; attention is a stand-in (q plus the
    repeated k + v), so the non-LoRA work is the same small elementwise ops for both kernels."""

    def __init__(self):
        super().__init__()
        for name, (fan_in, fan_out, bias) in PROJ.items():
            setattr(self, name, nn.Linear(fan_in, fan_out, bias=bias))

    def forward(self, h):
        attn = self.q_proj(h) + (self.k_proj(h) + self.v_proj(h)).repeat(1, HIDDEN // KV)
        h = h + self.o_proj(attn)
        return h + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Stack(nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(layers))

    def forward(self, h):
        for layer in self.layers:
            h = layer(h)
        return h


class One(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        fan_in, fan_out, bias = PROJ[name]
        setattr(self, name, nn.Linear(fan_in, fan_out, bias=bias))
        self.name = name

    def forward(self, x):
        return getattr(self, self.name)(x)


def lora_pair(base: nn.Module, rank: int) -> tuple[nn.Module, nn.Module]:
    from peft import LoraConfig, get_peft_model

    from lmstack.models.fused_lora import apply_fused_lora
    from lmstack.models.kernels import cast_adapters_to_base_dtype

    # init_lora_weights=False: a random (not zero) B, so the low-rank term and its gradients are not trivial
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(PROJ), init_lora_weights=False)
    peft = get_peft_model(base.to("cuda", torch.bfloat16), config)
    cast_adapters_to_base_dtype(peft)  # bf16 adapters on the bf16 base, as lmstack's setup_finetuning
    fused = copy.deepcopy(peft)
    count, skipped = apply_fused_lora(fused)
    assert count > 0 and not skipped, skipped
    return peft, fused


def step(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """One forward + backward; the input gradient is computed (as for every layer but the first in
    training) and dropped, so no step pays an accumulation the other does not."""
    x.grad = None
    out = model(x)
    out.backward(grad)
    return out


def time_ms(model: nn.Module, x: torch.Tensor, grad: torch.Tensor, warmup: int, iters: int):
    for _ in range(warmup):
        step(model, x, grad)
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(model, x, grad)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        model.zero_grad(set_to_none=True)
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30


def agreement(peft: nn.Module, fused: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> dict:
    """Max |fused - peft| / max |peft| of the output and of the adapter + input gradients (one step each)."""
    outs = {}
    for name, model in (("peft", peft), ("fused", fused)):
        model.zero_grad(set_to_none=True)
        out = step(model, x, grad).float()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.requires_grad])
        outs[name] = (out, torch.cat([grads, x.grad.float().flatten()]))
    rel = [
        ((f - p).abs().max() / p.abs().max()).item() for f, p in zip(outs["fused"], outs["peft"], strict=True)
    ]
    return {"out_rel_diff": rel[0], "grad_rel_diff": rel[1]}


def measure(name: str, base: nn.Module, tokens: int, rank: int, warmup: int, iters: int) -> dict:
    peft, fused = lora_pair(base, rank)
    fan_in = PROJ[name][0] if name in PROJ else HIDDEN
    fan_out = PROJ[name][1] if name in PROJ else HIDDEN
    gen = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(tokens, fan_in, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    grad = torch.randn(tokens, fan_out, device="cuda", dtype=torch.bfloat16, generator=gen)
    row = {"what": name}
    for kernel, model in (("peft", peft), ("fused", fused)):
        row[f"{kernel}_ms"], row[f"{kernel}_peak_gib"] = time_ms(model, x, grad, warmup, iters)
    row["speedup"] = row["peft_ms"] / row["fused_ms"]
    row.update(agreement(peft, fused, x, grad))
    del peft, fused
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4, help="decoder layers in the stack (0.5B has 24)")
    ap.add_argument("--tokens", type=int, default=32 * 2048, help="tokens per step (batch x sequence)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", type=Path, help="append one JSON line with the results to this file")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fused_lora_bench: needs a CUDA GPU")
    torch.manual_seed(0)
    rows = [measure(n, One(n), args.tokens, args.rank, args.warmup, args.iters) for n in PROJ]
    stack = measure(
        f"stack x{args.layers}", Stack(args.layers), args.tokens, args.rank, args.warmup, args.iters
    )
    rows.append(stack)
    head = f"{'what':<12} {'peft ms':>9} {'fused ms':>9} {'speedup':>8} {'peft GiB':>9} {'fused GiB':>9}"
    print(f"{args.tokens} tokens, LoRA r{args.rank}, bf16, {torch.cuda.get_device_name()}")
    print(head + f" {'out diff':>9} {'grad diff':>9}")
    for r in rows:
        print(
            f"{r['what']:<12} {r['peft_ms']:>9.3f} {r['fused_ms']:>9.3f} {r['speedup']:>7.2f}x "
            f"{r['peft_peak_gib']:>9.2f} {r['fused_peak_gib']:>9.2f} "
            f"{r['out_rel_diff']:>9.1e} {r['grad_rel_diff']:>9.1e}"
        )
    tokens_per_s = {k: args.tokens / (stack[f"{k}_ms"] / 1e3) for k in ("peft", "fused")}
    print(f"stack tokens/s: peft {tokens_per_s['peft']:,.0f}  fused {tokens_per_s['fused']:,.0f}")
    if args.out:
        import peft

        record = {
            "bench": "fused_lora",
            "settings": vars(args) | {"out": str(args.out)},
            "rows": rows,
            "gpu": torch.cuda.get_device_name(),
            "versions": {"torch": torch.__version__, "peft": peft.__version__},
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        }
        with args.out.open("a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
