"""The host-side decisions of a run, each (value, reason): how batches are built off the training loop's
critical path, which implementation of the optimizer steps it, and which heavy optional packages the
process never imports. They are speed decisions: none changes what is trained. A field the user wrote
is taken as written; an unset one gets the fastest choice measured to keep the results.

Measured on one H200 (bench/results/speed.jsonl, the 0.5B LoRA row, packed 32x2048, LF's YAML as an LF
user writes it): 108,424 tok/s as written; `dataloader_num_workers: 2` alone +14%; `optim:
adamw_torch_fused` alone +9%; both +18%.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmstack.config.schema import Config
from lmstack.config.stages import StageSpec
from lmstack.launch.context import LaunchContext

FUSED_ADAMW = "adamw_torch_fused"
FOREACH_ADAMW = "adamw_torch"
# worker processes that build batches while the GPU runs the step: two covered the collation of a
# 32x2048 packed batch on the H200 (more were not measured, and each one is a forked process)
DATA_WORKERS = 2
# cores each training process keeps for itself before any go to workers: its own Python thread, which
# launches the GPU work, and the pin-memory thread that copies finished batches into page-locked memory
CORES_KEPT = 2


@dataclass(frozen=True)
class LoaderPlan:
    """plan.loader: the Trainer's DataLoader settings. Batches come from `workers` forked processes
    (0: built in the training loop itself), copied into pinned memory; the workers are restarted at every
    epoch and evaluation rather than kept (`persistent_workers`: a kept iterator draws no new base seed
    from torch's global generator, which would shift every later dropout mask against a run without
    workers)."""

    workers: int
    reason: str
    pin_memory: bool = True  # transformers' dataloader_pin_memory default; lmstack keeps it
    persistent: bool = False


def data_loader(cfg: Config, ctx: LaunchContext, dev: str, spec: StageSpec, world: int) -> LoaderPlan:
    t, d = cfg.training, cfg.data
    if "dataloader_num_workers" in t.model_fields_set:
        return LoaderPlan(t.dataloader_num_workers, f"dataloader_num_workers: {t.dataloader_num_workers}")
    unset = "dataloader_num_workers unset"
    on_gpu = f"on a CUDA GPU it would be {DATA_WORKERS} worker processes"
    if not spec.trainer:
        return LoaderPlan(0, f"{unset}: stage {spec.name} reads its data in its own loop")
    if spec.generates:
        return LoaderPlan(
            0, f"{unset}: stage {spec.name} spends its steps generating; prompts are cheap to batch"
        )
    if d.streaming:
        return LoaderPlan(
            0, f"{unset}: streaming: true, workers would each read their own shard (a different sample order)"
        )
    if dev != "cuda":
        return LoaderPlan(
            0, f"{unset}: {dev.upper()} run, the step's compute uses the cores itself ({on_gpu})"
        )
    per_process = ctx.cpu_count // max(1, world // max(ctx.nnodes, 1))
    workers = max(0, min(DATA_WORKERS, per_process - CORES_KEPT))
    if workers == 0:
        return LoaderPlan(
            0, f"{unset}: {per_process} CPU cores per training process, none to spare for worker processes"
        )
    return LoaderPlan(
        workers,
        f"{unset}: {workers} worker processes build the next batches (collation, packed rows' positions) "
        "while the GPU runs the step; pinned memory; restarted each epoch (same batches and RNG stream "
        "as 0 workers; +14% on the 0.5B LoRA row on the H200)",
    )


def _method_optimizer(cfg: Config) -> str | None:
    """The method that builds its own optimizer (train/optimizers.py), if any; LoRA+ is not one: it takes
    the optimizer class the Trainer derives from `optim`."""
    ft = cfg.finetuning
    for name in ("use_galore", "use_apollo", "use_badam", "use_adam_mini", "use_muon"):
        if getattr(ft, name):
            return name
    return None


def optimizer(cfg: Config, dev: str, zero_stage: int | None, fsdp: bool) -> tuple[str, str]:
    """The `optim` value the Trainer gets. Unset, LF's AdamW runs as torch's fused kernel: the same update
    (decoupled weight decay, bias-corrected moments) computed in one kernel launch per parameter group
    instead of a few multi-tensor launches per operation, equal to the multi-tensor result up to float
    rounding. It is also transformers' own default on torch >= 2.8, so what LF itself runs."""
    t = cfg.training
    if "optim" in t.model_fields_set:
        hint = (
            f"; {FUSED_ADAMW} is the same update in one fused kernel (+9% on the 0.5B LoRA row on the H200)"
            if t.optim == FOREACH_ADAMW and dev == "cuda" and zero_stage is None and not fsdp
            else ""
        )
        return t.optim, f"optim: {t.optim}{hint}"
    unset = "optim unset"
    if method := _method_optimizer(cfg):
        return t.optim, f"{unset}: {method} builds its own optimizer"
    if zero_stage is not None or fsdp:
        what = f"DeepSpeed ZeRO-{zero_stage}" if zero_stage is not None else "FSDP"
        return FOREACH_ADAMW, (
            f"{unset}: {what} steps the optimizer over its own partitions; torch's multi-tensor (foreach) "
            f"AdamW ({FOREACH_ADAMW}), the fused kernel is not measured there"
        )
    where = (
        "torch's fused AdamW kernel"
        if dev == "cuda"
        else f"torch's fused AdamW kernel for {dev} (on a CUDA GPU: the CUDA fused kernel)"
    )
    return FUSED_ADAMW, (
        f"{unset}: {FUSED_ADAMW}, {where}: the same AdamW math as {FOREACH_ADAMW} in one kernel per parameter group "
        "(equal up to float rounding; transformers' default on torch >= 2.8; +9% on the 0.5B LoRA row on the H200)"
    )


# Optional packages that transformers (its quantizers) and peft (its helpers) import whenever they are
# installed, whether or not the run uses them: on the 2-core CPU box that was 3.1 s (torchao) and 3.4 s
# (bitsandbytes) of a tiny LoRA run's start-up, plus their load warnings in the log
UNUSED_IMPORTS = ("torchao", "bitsandbytes")


def kept_out(cfg: Config, ctx: LaunchContext, spec: StageSpec, fp8: bool, unsloth: bool) -> tuple[tuple, str]:
    """The packages of UNUSED_IMPORTS this run never needs: `lmstack train` keeps them out of its process
    (train/run.py). Anything that may reach them keeps them in: FP8 (torchao), quantization_bit or a
    pre-quantized checkpoint, an optimizer other than torch's AdamW (bitsandbytes' and torchao's 8-bit
    ones), a method optimizer, Unsloth, remote modelling code, a generating stage."""
    from lmstack.plan.model_config import config_json

    t, m = cfg.training, cfg.model
    installed = [p for p in UNUSED_IMPORTS if ctx.has(p)]
    if not installed:
        return (), "torchao and bitsandbytes are not installed"
    reasons = [
        (m.quantization_bit is not None, "quantization_bit"),
        (bool((config_json(cfg) or {}).get("quantization_config")), "a pre-quantized checkpoint"),
        (t.optim not in (FUSED_ADAMW, FOREACH_ADAMW), f"optim: {t.optim}"),
        (_method_optimizer(cfg) is not None, str(_method_optimizer(cfg))),
        (unsloth, "use_unsloth"),
        (m.trust_remote_code, "trust_remote_code"),
        (spec.generates, f"stage {spec.name} generates"),
    ]
    common = [why for hit, why in reasons if hit]
    keep = [] if common else [p for p in installed if not (p == "torchao" and fp8)]
    if not keep:
        why = ", ".join(common) or "fp8: true (torchao)"
        return (), f"imported as transformers/peft do (this run may use them: {why})"
    held = [p for p in installed if p not in keep]
    return tuple(keep), (
        f"{', '.join(keep)} installed but unused by this run: kept out of the `lmstack train` process "
        "(transformers and peft import them whenever installed; seconds of start-up and their warnings)"
        + (f"; {', '.join(held)} kept in: fp8: true" if held else "")
    )


def inference_kept_out(cfg: Config, ctx: LaunchContext) -> tuple[str, ...]:
    """The packages of UNUSED_IMPORTS that chat / api / export never reach on this config: a transformers
    model in full precision, from lmstack's own modelling code. quantization_bit, a pre-quantized
    checkpoint, remote modelling code or a vLLM/SGLang engine keep them in."""
    from lmstack.plan.model_config import config_json

    m = cfg.model
    reaches = (
        m.quantization_bit is not None
        or bool((config_json(cfg) or {}).get("quantization_config"))
        or m.trust_remote_code
        or m.infer_backend != "huggingface"
    )
    return () if reaches else tuple(p for p in UNUSED_IMPORTS if ctx.has(p))
