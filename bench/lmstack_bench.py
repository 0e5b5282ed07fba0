"""Side-by-side throughput benchmark: LLaMA-Factory's best config (team kit, bench/lf/lf_run.py) and
lmstack's real `train` path on the same assets, one subprocess per run, one JSON line per run.

    python3 bench/lmstack_bench.py all --assets /tmp/assets --set default --budget 540
        runs the set, appends to bench/results/speed.jsonl (and $OUT/speed.jsonl when OUT is set)
    python3 bench/lmstack_bench.py lmstack-one NAME CONFIG_JSON     (internal: one lmstack run)

Steady state = real (non-padding) tokens between the end of step WARMUP and the end of training over
the wall time between those points (CUDA-synchronised), exactly as the kit measures LLaMA-Factory.
Environments: LLaMA-Factory runs with PYTHONPATH=/tmp/site (its pinned wheels), lmstack with
PYTHONPATH=/tmp/site_lm:<repo>/src (the machine's transformers/torch/peft + pydantic + liger).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchproc import result_from_log, run_killable  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WARMUP = 10
PROFILE_STEPS = 2  # lmstack runs: the last steps are profiled (after the timed window)
LF_SITE = "/tmp/site"
LM_SITE = "/tmp/site_lm"

# ---- run definitions ------------------------------------------------------------------------------
COMMON = dict(
    template="qwen", stage="sft", do_train=True, dataset="synth", cutoff_len=2048, max_samples=3000,
    preprocessing_num_workers=8, logging_steps=10, save_strategy="no", overwrite_output_dir=True,
    learning_rate=1e-4, lr_scheduler_type="cosine", warmup_ratio=0.05, bf16=True, report_to="none",
    seed=42, overwrite_cache=True,
)  # fmt: skip
LF_EXTRA = dict(include_effective_tokens_per_second=True, flash_attn="sdpa")
LF_BEST = dict(
    packing=True, enable_liger_kernel=True
)  # LF's fastest settings (its packing attends across samples)
LORA = dict(finetuning_type="lora", lora_target="all", lora_rank=8, lora_alpha=16)
FULL = dict(finetuning_type="full")
# lmstack: contamination-free packing (flex_attention BlockMask on CUDA via flash_attn: auto), fused
# linear CE (Liger), bf16 LoRA adapters, checkpointing decided by the planner, large token batches.
LM_BEST = dict(
    packing=True, enable_liger_kernel=True, flash_attn="auto", gradient_checkpointing="auto",
    optim="adamw_torch_fused", disable_tqdm=True, dataloader_num_workers=2,
    overwrite_cache=False,  # lmstack's tokenized cache is keyed on data + tokenizer + options: runs share it
)  # fmt: skip
NO_LIGER = {"enable_liger_kernel": False}  # fallback: lmstack's own chunked linear CE
SDPA = {"enable_liger_kernel": False, "flash_attn": "sdpa"}  # last resort: no flex_attention either


@dataclass
class Run:
    system: str  # "llamafactory" | "lmstack" | "unsloth"
    name: str
    arch: str
    method: str
    cfg: dict
    timeout: int
    fallbacks: list[dict] = field(default_factory=list)
    workload: str = ""  # issue 19's row name: 0.5b_full | 0.5b_lora | 7b_lora_bs8 | 7b_lora_24g
    site: str = ""  # "uns": lmstack run inside Unsloth's environment (use_unsloth: true needs the package)
    # "as_written": the YAML an LF user writes (LF's fields only; lmstack's plan picks the rest), the line's
    # `settings` is this label and `yaml` the fields; "" -> `settings` holds the fields as before
    label: str = ""


def runs(set_name: str) -> list[Run]:
    lf = lambda extra, steps: {**COMMON, **LF_EXTRA, **LF_BEST, **extra, "per_device_train_batch_size": 4,  # noqa: E731
                               "max_steps": steps}  # fmt: skip
    lm = lambda extra, bs, steps: {**COMMON, **LM_BEST, **extra, "per_device_train_batch_size": bs,  # noqa: E731
                                   "max_steps": steps}  # fmt: skip
    small = [
        Run("llamafactory", "lf_0.5b_full_pack_liger", "qwen2.5-0.5b", "full", lf(FULL, 60), 150),
        Run("lmstack", "lmstack_0.5b_full", "qwen2.5-0.5b", "full", lm(FULL, 32, 32), 180, [NO_LIGER, SDPA]),
        Run("llamafactory", "lf_0.5b_lora_pack_liger", "qwen2.5-0.5b", "lora", lf(LORA, 60), 150),
        Run("lmstack", "lmstack_0.5b_lora", "qwen2.5-0.5b", "lora", lm(LORA, 32, 32), 180, [NO_LIGER, SDPA]),
    ]
    big = [
        Run("llamafactory", "lf_7b_lora_pack_liger", "qwen2.5-7b", "lora", lf(LORA, 30), 180),
        Run("lmstack", "lmstack_7b_lora", "qwen2.5-7b", "lora", lm(LORA, 4, 22), 200, [NO_LIGER, SDPA]),
    ]
    short = {"cutoff_len": 512, "max_samples": 400}  # smoke: a quick end-to-end check of both paths
    smoke = [
        Run("llamafactory", "lf_smoke", "qwen2.5-0.5b", "full", {**lf(FULL, 12), **short}, 120),
        Run(
            "lmstack",
            "lmstack_smoke",
            "qwen2.5-0.5b",
            "full",
            {**lm(FULL, 4, 12), **short},
            150,
            [NO_LIGER, SDPA],
        ),
    ]

    # issue 19: the peers tuned as their users tune them (same token batch, checkpointing off where it
    # fits; LF's fastest: packing + Liger), next to lmstack, one workload name per row
    def lf_tuned(extra, bs, steps, ckpt):
        cfg = {
            **COMMON,
            **LF_EXTRA,
            **LF_BEST,
            **extra,
            "per_device_train_batch_size": bs,
            "max_steps": steps,
        }
        return cfg if ckpt else {**cfg, "disable_gradient_checkpointing": True}

    fused, peft = {"lora_kernel": "fused"}, {"lora_kernel": "peft"}
    fp8, compiled = {"fp8": True}, {"torch_compile": True}
    tuned05 = [
        Run(
            "llamafactory",
            "lf_0.5b_full_bs32",
            "qwen2.5-0.5b",
            "full",
            lf_tuned(FULL, 32, 30, False),
            200,
            workload="0.5b_full",
        ),
        Run(
            "lmstack",
            "lm_0.5b_full_bs32",
            "qwen2.5-0.5b",
            "full",
            lm(FULL, 32, 32),
            200,
            [NO_LIGER],
            "0.5b_full",
        ),
        Run(
            "llamafactory",
            "lf_0.5b_lora_bs32",
            "qwen2.5-0.5b",
            "lora",
            lf_tuned(LORA, 32, 30, False),
            200,
            workload="0.5b_lora",
        ),
        Run(
            "lmstack",
            "lm_0.5b_lora_bs32_fused",
            "qwen2.5-0.5b",
            "lora",
            {**lm(LORA, 32, 32), **fused},
            200,
            [NO_LIGER],
            "0.5b_lora",
        ),
        Run(
            "lmstack",
            "lm_0.5b_lora_bs32_peft",
            "qwen2.5-0.5b",
            "lora",
            {**lm(LORA, 32, 32), **peft},
            200,
            [NO_LIGER],
            "0.5b_lora",
        ),
    ]
    tuned7 = [
        Run("llamafactory", "lf_7b_lora_bs8", "qwen2.5-7b", "lora", lf_tuned(LORA, 8, 20, False), 240, workload="7b_lora_bs8"),
        Run("lmstack", "lm_7b_lora_bs8_fused", "qwen2.5-7b", "lora", {**lm(LORA, 8, 20), **fused}, 240, [NO_LIGER], "7b_lora_bs8"),
        Run("llamafactory", "lf_7b_lora_bs8_ckpt", "qwen2.5-7b", "lora", lf_tuned(LORA, 8, 20, True), 240, workload="7b_lora_24g"),
        Run("lmstack", "lm_7b_lora_bs8_ckpt_fused", "qwen2.5-7b", "lora",
            {**lm(LORA, 8, 20), **fused, "gradient_checkpointing": True}, 240, [NO_LIGER], "7b_lora_24g"),
    ]  # fmt: skip
    # issue 19: each 7B row with every peer in one call (LF tuned, Unsloth's fast path, lmstack's variants);
    # one call per row fits the 10-minute limit. Unsloth's cfg: bench/unsloth/unsloth_run.py's arguments
    lm7 = {**lm(LORA, 8, 20), **fused}
    peers7_bs8 = [
        Run(
            "llamafactory",
            "lf_7b_lora_bs8",
            "qwen2.5-7b",
            "lora",
            lf_tuned(LORA, 8, 20, False),
            240,
            workload="7b_lora_bs8",
        ),
        Run(
            "unsloth",
            "uns_7b_lora_bs8",
            "qwen2.5-7b",
            "lora",
            {"bs": 8, "steps": 20, "ckpt": "none"},
            240,
            workload="7b_lora_bs8",
        ),
        Run("lmstack", "lm_7b_lora_bs8_fused", "qwen2.5-7b", "lora", lm7, 200, [NO_LIGER], "7b_lora_bs8"),
        Run(
            "lmstack",
            "lm_7b_lora_bs8_fp8",
            "qwen2.5-7b",
            "lora",
            {**lm7, "fp8": True},
            200,
            [NO_LIGER],
            "7b_lora_bs8",
        ),
    ]
    peers7_24g = [
        Run("llamafactory", "lf_7b_lora_bs8_unsloth_gc", "qwen2.5-7b", "lora",
            {**lf_tuned(LORA, 8, 20, True), "use_unsloth_gc": True}, 240, workload="7b_lora_24g"),
        Run("unsloth", "uns_7b_lora_bs8_gc", "qwen2.5-7b", "lora", {"bs": 8, "steps": 20, "ckpt": "unsloth"}, 240, workload="7b_lora_24g"),
        Run("lmstack", "lm_7b_lora_bs8_ckpt_fused", "qwen2.5-7b", "lora", {**lm7, "gradient_checkpointing": True}, 200, [NO_LIGER], "7b_lora_24g"),
        Run("lmstack", "lm_7b_lora_bs8_unsloth_gc_fp8", "qwen2.5-7b", "lora", {**lm7, "use_unsloth_gc": True, "fp8": True, "gradient_checkpointing": True}, 200, [NO_LIGER], "7b_lora_24g"),
        # the planner's own choice for a 24 GiB GPU (emulated): offloaded checkpointing on the fewest layers
        Run("lmstack", "lm_7b_lora_bs8_auto24_unsloth_gc_fp8", "qwen2.5-7b", "lora",
            {**lm7, "use_unsloth_gc": True, "fp8": True, "_gpu_gib": 24}, 200, [NO_LIGER], "7b_lora_24g"),
        Run("lmstack", "lm_7b_lora_bs8_use_unsloth", "qwen2.5-7b", "lora",
            {**lm(LORA, 8, 20), "use_unsloth": True, "enable_liger_kernel": False, "gradient_checkpointing": True}, 240,
            workload="7b_lora_24g", site="uns"),
    ]  # fmt: skip
    # regional torch.compile (each decoder layer, plan.compile) on top of the best lmstack settings;
    # compare with tuned05's lm_ rows of the same call
    compiled05 = [
        Run("lmstack", "lm_0.5b_full_bs32_compile", "qwen2.5-0.5b", "full", {**lm(FULL, 32, 32), **compiled}, 300,
            [NO_LIGER], "0.5b_full"),
        Run("lmstack", "lm_0.5b_lora_bs32_fused_compile", "qwen2.5-0.5b", "lora",
            {**lm(LORA, 32, 32), **fused, **compiled}, 300, [NO_LIGER], "0.5b_lora"),
    ]  # fmt: skip
    t05 = {r.name: r for r in tuned05}
    sets = {
        # the 24 GiB row again: the peers, lmstack's all-layer offload, and the planner's fewest-layer offload
        "peers7_24g_auto": [
            r for r in peers7_24g if r.site != "uns" and r.name != "lm_7b_lora_bs8_ckpt_fused"
        ],
        "peers7": peers7_bs8 + peers7_24g,  # both 7B rows; a second call with --skip-done finishes them
        "peers7_bs8": peers7_bs8,
        "peers7_24g": peers7_24g,
        "tuned05": tuned05,
        "tuned7": tuned7,
        "default": small + big,
        "small": small,
        "full05": small[:2],  # 0.5B full only: LF's best and lmstack's
        "big": big,
        "lmstack": [r for r in small + big if r.system == "lmstack"],
        "smoke": smoke,
        "compile": compiled05,
        # regional compile on and off in one call, with LF tuned on the same rows (issue 19's 0.5B rows)
        "compile05": [
            t05["lm_0.5b_full_bs32"],
            compiled05[0],
            t05["lm_0.5b_lora_bs32_fused"],
            compiled05[1],
            t05["lf_0.5b_full_bs32"],
            t05["lf_0.5b_lora_bs32"],
        ],  # fmt: skip
        # FP8 (plan.fp8): full -> torchao float8 training, LoRA -> FP8 frozen base; same rows as tuned05/7.
        # On the 0.5B no projection is large enough for FP8 to pay: the plan notes it and runs bf16
        "fp8": [
            Run(
                "lmstack",
                "lm_0.5b_full_bs32_fp8",
                "qwen2.5-0.5b",
                "full",
                {**lm(FULL, 32, 32), **fp8},
                300,
                [NO_LIGER],
                "0.5b_full",
            ),
            Run(
                "lmstack",
                "lm_0.5b_lora_bs32_fused_fp8",
                "qwen2.5-0.5b",
                "lora",
                {**lm(LORA, 32, 32), **fused, **fp8},
                300,
                [NO_LIGER],
                "0.5b_lora",
            ),
            Run(
                "lmstack",
                "lm_7b_lora_bs8_fused_fp8",
                "qwen2.5-7b",
                "lora",
                {**lm(LORA, 8, 20), **fused, **fp8},
                300,
                [NO_LIGER],
                "7b_lora_bs8",
            ),
            Run(
                "lmstack",
                "lm_7b_lora_bs8_ckpt_fused_fp8",
                "qwen2.5-7b",
                "lora",
                {**lm(LORA, 8, 20), **fused, **fp8, "gradient_checkpointing": True},
                300,
                [NO_LIGER],
                "7b_lora_24g",
            ),
        ],  # fmt: skip
        # both: FP8 with regional compile (the FP8 casts fuse into the compiled layers)
        "fp8_compile": [
            Run(
                "lmstack",
                "lm_0.5b_full_bs32_fp8_compile",
                "qwen2.5-0.5b",
                "full",
                {**lm(FULL, 32, 32), **fp8, **compiled},
                300,
                [NO_LIGER],
                "0.5b_full",
            ),
            Run(
                "lmstack",
                "lm_7b_lora_bs8_fused_fp8_compile",
                "qwen2.5-7b",
                "lora",
                {**lm(LORA, 8, 20), **fused, **fp8, **compiled},
                300,
                [NO_LIGER],
                "7b_lora_bs8",
            ),
        ],  # fmt: skip
    }
    sets["as_written05"] = as_written05(lf_tuned, t05)
    return sets[set_name]


def as_written05(lf_tuned, t05: dict) -> list[Run]:
    """The 0.5B full and LoRA rows in one call: LF tuned as its users tune it; lmstack with the YAML an LF
    user writes (LF's fields only, `optim` and `dataloader_num_workers` unset: the plan's fast defaults),
    the same YAML with those two written as LF's defaults (the old as-written speed), and lmstack tuned."""
    out = []
    for method, extra in (("lora", LORA), ("full", FULL)):  # LoRA first: its as-written gap was the larger
        lf_row = t05[f"lf_0.5b_{method}_bs32"]
        yaml = {k: v for k, v in lf_tuned(extra, 32, 32, False).items() if k not in LF_EXTRA}
        work = f"0.5b_{method}"
        tuned = t05["lm_0.5b_full_bs32" if method == "full" else "lm_0.5b_lora_bs32_fused"]
        out += [
            lf_row,
            Run("lmstack", f"lm_0.5b_{method}_as_written", "qwen2.5-0.5b", method, yaml, 200, [NO_LIGER], work,
                label="as_written"),
            Run("lmstack", f"lm_0.5b_{method}_as_written_lf_defaults", "qwen2.5-0.5b", method,
                {**yaml, "optim": "adamw_torch", "dataloader_num_workers": 0}, 200, [NO_LIGER], work,
                label="as_written_lf_defaults"),
            replace(tuned, label="tuned"),
        ]  # fmt: skip
    return out


# ---- one lmstack run (subprocess) ----------------------------------------------------------------
def emulate_smaller_gpu(gib: float) -> None:
    """The 24 GiB row on an H200: the run plan sees a GPU of `gib` GiB (so `auto` sizes for it) and the
    caching allocator is capped at that much (a run that needs more fails with an OOM, as on such a card).
    One process only: a torchrun relaunch (several visible GPUs) would start workers without the patch."""
    from dataclasses import replace

    import torch

    import lmstack.launch.context as context

    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    torch.cuda.set_per_process_memory_fraction(min(gib / total, 1.0), 0)
    real = context.LaunchContext.from_env.__func__

    def from_env(cls, *args, **kwargs):
        ctx = real(cls, *args, **kwargs)
        return replace(ctx, gpu_memory_gib=min(gib, ctx.gpu_memory_gib or gib))

    context.LaunchContext.from_env = classmethod(from_env)
    logging.getLogger("lmstack").info(
        "bench: emulating a %.0f GiB GPU (the plan's memory, the allocator's cap)", gib
    )


def lmstack_one(name: str, cfg: dict) -> None:
    import torch
    from transformers import TrainerCallback

    notes: list[str] = []

    class Notes(logging.Handler):
        KEYS = (
            "packing:",
            "liger",
            "chunked",
            "gradient_checkpointing:",
            "loaded ",
            "LoRA adapters",
            "fused",
            "master_weights",
            "fp8",
            "torch_compile",
        )

        def emit(self, record):
            msg = record.getMessage()
            if any(k in msg for k in self.KEYS):
                notes.append(msg[:300])

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("lmstack").addHandler(Notes())

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    last = int(cfg.get("max_steps", 0))
    profile_from = (
        last - PROFILE_STEPS if torch.cuda.is_available() and last > WARMUP + 2 * PROFILE_STEPS else None
    )

    class Steady(TrainerCallback):
        """Times steps WARMUP..profile_from (or ..end), then profiles the last PROFILE_STEPS steps."""

        t0 = tok0 = t1 = tok1 = prof = None
        profile: dict = {}

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == WARMUP:
                sync()
                self.t0, self.tok0 = time.perf_counter(), state.num_input_tokens_seen
            if state.global_step == profile_from:
                sync()
                self.t1, self.tok1 = time.perf_counter(), state.num_input_tokens_seen
                self.prof = start_profile()

        def on_train_end(self, args, state, control, **kw):
            sync()
            if self.t1 is None:
                self.t1, self.tok1 = time.perf_counter(), state.num_input_tokens_seen
            if self.prof is not None:
                self.profile = stop_profile(self.prof, self.t1)

    import lmstack.train.common as common
    from lmstack.train.run import train

    cfg = dict(cfg)
    gpu_gib = cfg.pop("_gpu_gib", None)
    if gpu_gib and torch.cuda.is_available():
        emulate_smaller_gpu(float(gpu_gib))
    steady = Steady()
    make_callbacks = common.make_callbacks
    common.make_callbacks = lambda c: make_callbacks(c) + [steady]  # the real stage, plus a timer
    start = time.time()
    metrics = train(None, cfg)
    wall = time.time() - start
    cuda = torch.cuda.is_available()
    rate = (steady.tok1 - steady.tok0) / (steady.t1 - steady.t0) if steady.t0 else None
    print(
        "RESULT",
        json.dumps(
            {
                "name": name,
                "wall_s": round(wall, 1),
                "steady_tokens_per_sec": round(rate) if rate else None,
                "steady_tokens": steady.tok1 - steady.tok0 if steady.t0 else None,
                "train_loss": metrics.get("train_loss"),
                "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
                "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda else None,
                "notes": notes,
                "profile": steady.profile,
            }
        ),
        flush=True,
    )


def start_profile():
    import torch

    try:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        prof.start()
        return prof
    except Exception as err:  # noqa: BLE001 - profiling is optional; the timing stands without it
        print("profiler not started:", err, flush=True)
        return None


KERNEL_GROUPS = (  # first match wins; names of cuBLAS/CUTLASS/Triton/Liger/flex kernels
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul")),
    ("attention (flex/sdpa)", ("flex", "attention", "fmha", "flash", "triton_tem")),
    ("cross-entropy / lm_head", ("cross_entropy", "fused_linear", "liger_cross", "logsumexp", "_ce_")),
    ("norm / rope / swiglu", ("rms_norm", "rmsnorm", "rope", "swiglu", "silu")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("copies / casts", ("copy", "cast", "to_copy", "memcpy", "memset", "fill")),
)


def stop_profile(prof, t_start: float) -> dict:
    """Share of GPU kernel time by kind, the top kernels, and how busy the GPU was."""
    import torch

    try:
        torch.cuda.synchronize()
        wall = time.perf_counter() - t_start
        prof.stop()
        rows = []
        for ev in prof.key_averages():
            t = getattr(ev, "self_device_time_total", None)
            if t is None:
                t = getattr(ev, "self_cuda_time_total", 0)
            if t and t > 0:
                rows.append((ev.key, t / 1e6))
        busy = sum(t for _, t in rows)
        total = busy or 1.0
        groups: dict[str, float] = {}
        for key, t in rows:
            low = key.lower()
            kind = next((g for g, pats in KERNEL_GROUPS if any(p in low for p in pats)), "other elementwise")
            groups[kind] = groups.get(kind, 0.0) + t
        rows.sort(key=lambda r: -r[1])
        return {
            "steps": PROFILE_STEPS,
            "wall_s": round(wall, 3),
            "kernel_s": round(busy, 3),
            "gpu_busy": round(busy / wall, 3) if wall else None,
            "by_kind": {k: round(v / total, 3) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
            "top": [[k[:90], round(t / total, 3)] for k, t in rows[:15]],
        }
    except Exception as err:  # noqa: BLE001
        return {"error": str(err)[:300]}


# ---- orchestration -------------------------------------------------------------------------------
DONE_FILE = "/tmp/speed_done.jsonl"  # every line of this machine's calls: --skip-done survives a re-sent tree
UNS_SITE = (
    "/tmp/site_uns"  # Unsloth's pinned wheels (.whl/uns + .whl/bnb + .whl/ao), never mixed with LM_SITE
)


def _env(system: str, site: str = "") -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", DISABLE_VERSION_CHECK="1",
               TOKENIZERS_PARALLELISM="false", PYTHONHASHSEED="0")  # fmt: skip
    if system == "llamafactory":
        env["PYTHONPATH"] = LF_SITE
    elif system == "unsloth":
        env["PYTHONPATH"] = UNS_SITE
    else:  # lmstack; with site "uns" inside Unsloth's environment (use_unsloth: true)
        env["PYTHONPATH"] = f"{UNS_SITE if site == 'uns' else LM_SITE}:{REPO / 'src'}"
    return env


def versions(system: str, site: str = "") -> dict:
    names = ["torch", "transformers", "peft", "accelerate", "liger_kernel", "triton"]
    names += {"llamafactory": ["llamafactory"], "unsloth": ["unsloth", "unsloth_zoo", "trl", "torchao"]}.get(
        system, ["pydantic", "torchao"]
    )
    code = (
        "import json, importlib.metadata as m\nout = {}\n"
        f"for n in {names!r}:\n"
        "    try: out[n] = m.version(n.replace('_', '-'))\n"
        "    except Exception: out[n] = None\n"
        "print(json.dumps(out))"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], env=_env(system, site), capture_output=True, text=True, timeout=60
        )
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        out = {}
    if system == "lmstack":
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
            )
            out["lmstack_commit"] = commit.stdout.strip() or None
        except OSError:
            out["lmstack_commit"] = None
        # the device machine's copy of the tree can carry stale git metadata (its commit was the session's
        # first): the code that ran, by content -- compare with `python3 bench/lmstack_bench.py tree-digest`
        out["lmstack_tree"] = tree_digest()
    return out


def tree_digest() -> str:
    """A short hash of src/lmstack's Python files (paths and bytes): which code a result line came from."""
    import hashlib

    h = hashlib.sha256()
    for path in sorted((REPO / "src" / "lmstack").rglob("*.py")):
        h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def gpu_name() -> str:
    try:
        proc = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        )
        return proc.stdout.strip().splitlines()[0]
    except (OSError, IndexError):
        return "unknown"


def last_logged_loss(output_dir: Path) -> tuple[float | None, int | None]:
    path = output_dir / "trainer_log.jsonl"
    if not path.is_file():
        return None, None
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    rows = [r for r in rows if r.get("loss") is not None]
    return (rows[-1]["loss"], rows[-1].get("current_steps")) if rows else (None, None)


def execute(run: Run, cfg: dict, timeout: float, log_path: Path) -> tuple[int, dict | None]:
    if run.system == "llamafactory":
        cmd = [sys.executable, str(REPO / "bench/lf/lf_run.py"), json.dumps(cfg), run.name]
    elif run.system == "unsloth":  # the same assets: bench/unsloth/unsloth_run.py reads them itself
        assets = str(Path(cfg["model_name_or_path"]).parent)
        cmd = [sys.executable, str(REPO / "bench/unsloth/unsloth_run.py"), run.name, "--bs", str(cfg["bs"]),
               "--steps", str(cfg["steps"]), "--ckpt", cfg["ckpt"], "--assets", assets, "--arch", run.arch]  # fmt: skip
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "lmstack-one", run.name, json.dumps(cfg)]
    rc = run_killable(cmd, _env(run.system, run.site), timeout, log_path)
    return rc, result_from_log(log_path)


def run_all(args: argparse.Namespace) -> None:
    deadline = time.time() + args.budget
    run_id = args.run_id or dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    results = REPO / "bench/results/speed.jsonl"
    results.parent.mkdir(parents=True, exist_ok=True)
    gpu = gpu_name()
    vers = {s: versions(s) for s in ("llamafactory", "lmstack", "unsloth")}
    vers["lmstack_uns"] = versions("lmstack", "uns")
    print("versions", json.dumps(vers), flush=True)
    systems = set(args.systems.split(","))
    tag = "" if systems == {"llamafactory", "lmstack"} else "_" + "_".join(sorted(systems))
    sticky: dict | None = None  # a fallback that rescued one lmstack run is tried first for the next
    done = made_runs(run_id, [results, Path(DONE_FILE)]) if args.skip_done else set()
    for run in runs(args.set):
        if run.system not in systems or run.name in done:
            continue
        base = {
            **run.cfg,
            "model_name_or_path": f"{args.assets}/{run.arch}",
            "dataset_dir": f"{args.assets}/data",
        }
        line = {"system": run.system, "model": run.arch, "method": run.method, "run_id": run_id, "name": run.name,
                "workload": run.workload or None, "gpu": gpu, "versions": vers["lmstack_uns" if run.site == "uns" else run.system]}  # fmt: skip
        overrides = [{}, *run.fallbacks]
        if sticky is not None and run.fallbacks:  # what rescued an earlier run goes first
            overrides = [sticky] + [o for o in overrides if o != sticky]
        for i, extra in enumerate(overrides):
            left = deadline - time.time()
            if left < 60:
                line.update(status="skipped", reason=f"budget: {left:.0f}s left")
                break
            cfg = {**base, **extra, "output_dir": f"/tmp/out/{run.name}_{i}"}
            log_path = logs / f"{run.name}{'' if i == 0 else f'_attempt{i}'}.log"
            t = time.time()
            rc, res = execute(run, cfg, min(run.timeout, left), log_path)
            loss, loss_step = last_logged_loss(Path(cfg["output_dir"]))
            settings = {
                k: v
                for k, v in cfg.items()
                if k not in COMMON and k not in ("model_name_or_path", "dataset_dir")
            }
            line.update(status="ok" if res and res.get("steady_tokens_per_sec") else "failed", rc=rc,
                        elapsed_s=round(time.time() - t, 1), settings=settings, fallback=extra or None,
                        loss_after_steps=loss, loss_step=loss_step)  # fmt: skip
            if run.label:  # the YAML as an LF user writes it: `settings` names that, `yaml` is what ran
                line.update(settings=run.label, yaml=settings)
            if run.system == "lmstack":
                line["plan"] = plan_decisions(Path(cfg["output_dir"]))
            if res:
                line.update({k: v for k, v in res.items() if k != "name"})
            if line["status"] == "ok":
                if extra:
                    sticky = extra
                break
            tail = log_path.read_text(errors="replace").splitlines()[-15:]
            line["error_tail"] = tail
        line.setdefault("steady_tokens_per_sec", None)
        line.setdefault("peak_alloc_gib", None)
        line.setdefault("loss_after_steps", None)
        line["date"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        text = json.dumps(line)
        print("LINE", text, flush=True)
        for path in (results, Path(DONE_FILE)):
            with path.open("a") as fh:
                fh.write(text + "\n")
        if out_dir is not None:  # what comes back from the GPU machine, refreshed after every run
            with (out_dir / f"speed{tag}.jsonl").open("a") as fh:
                fh.write(text + "\n")
            with tarfile.open(out_dir / f"bench_logs{tag}.tar.gz", "w:gz") as tar:
                tar.add(logs, arcname=logs.name)
    summarize(results, run_id)


def plan_decisions(output_dir: Path) -> dict | None:
    """The run plan's host-side and kernel decisions with their reasons, from the run's manifest."""
    try:
        plan = json.loads((output_dir / "run_manifest.json").read_text())["plan"]
    except (OSError, KeyError, TypeError, ValueError):
        return None
    keys = (
        "data_workers",
        "optimizer",
        "attention",
        "loss_kernel",
        "lora_kernel",
        "checkpointing",
        "micro_batch",
    )
    decisions, reasons = plan.get("decisions") or {}, plan.get("reasons") or {}
    return {k: {"value": decisions.get(k), "why": reasons.get(k)} for k in keys if k in decisions}


def made_runs(run_id: str, paths: list[Path]) -> set[str]:
    """Names of the runs of `run_id` already made (ok; a failed or skipped run is made again)."""
    names = set()
    for path in paths:
        if path.is_file():
            for text in path.read_text().splitlines():
                row = json.loads(text) if text.strip() else {}
                if row.get("run_id") == run_id and row.get("status") == "ok":
                    names.add(row["name"])
    return names


def summarize(results: Path, run_id: str) -> None:
    rows = [json.loads(x) for x in results.read_text().splitlines() if x.strip()]
    rows = [r for r in rows if r.get("run_id") == run_id]
    best_lf: dict = {}
    for r in rows:
        key = r.get("workload") or (r["model"], r["method"])
        if r["system"] != "lmstack" and r.get("steady_tokens_per_sec"):
            best_lf[key] = max(best_lf.get(key, 0), r["steady_tokens_per_sec"])
    print(f"\nrun {run_id}: steady tokens/s (real tokens), peak alloc GiB")
    for r in rows:
        key = r.get("workload") or (r["model"], r["method"])
        ratio = ""
        if r["system"] == "lmstack" and best_lf.get(key) and r.get("steady_tokens_per_sec"):
            ratio = f"  {r['steady_tokens_per_sec'] / best_lf[key]:.2f}x best peer"
        print(f"  {r['name']:28s} {str(r.get('workload')):12s} {r.get('status'):7s} {r.get('steady_tokens_per_sec')!s:>8} tok/s"
              f"  {r.get('peak_alloc_gib')!s:>6} GiB  loss {r.get('loss_after_steps')}{ratio}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("all")
    a.add_argument("--assets", default="/tmp/assets")
    a.add_argument(
        "--set",
        default="default",
        choices=[
            "default",
            "small",
            "full05",
            "big",
            "lmstack",
            "smoke",
            "compile",
            "tuned05",
            "tuned7",
            "peers7",
            "peers7_bs8",
            "peers7_24g",
            "peers7_24g_auto",
            "compile05",
            "fp8",
            "fp8_compile",
            "as_written05",
        ],  # fmt: skip
    )
    a.add_argument("--budget", type=float, default=540, help="seconds for all runs together")
    a.add_argument("--run-id", default=None)
    a.add_argument("--skip-done", action="store_true",
                   help=f"skip runs of this --run-id already made (ok) in speed.jsonl or {DONE_FILE}")  # fmt: skip
    a.add_argument(
        "--systems",
        default="llamafactory,lmstack",
        help="which systems' runs to make (one GPU stream each on a 2-GPU machine)",
    )
    a.add_argument("--logs", default="/tmp/bench_logs")
    sub.add_parser("tree-digest", help="print the hash of src/lmstack that result lines carry (lmstack_tree)")
    one = sub.add_parser("lmstack-one")
    one.add_argument("name")
    one.add_argument("config")
    args = parser.parse_args()
    if args.cmd == "all":
        run_all(args)
    elif args.cmd == "tree-digest":
        print(tree_digest())
    else:
        lmstack_one(args.name, json.loads(args.config))


if __name__ == "__main__":
    main()
