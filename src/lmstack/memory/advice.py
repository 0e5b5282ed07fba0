"""What the planner says and checks about one candidate: the YAML changes that make a run match it,
the words of the recommendation, and what this machine / this stage cannot run (the rules `lmstack
check` and `lmstack train` apply), plus the disk a checkpoint needs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmstack.memory import memory as mem
from lmstack.memory.estimate import Setup
from lmstack.memory.model_spec import ModelSpec

if TYPE_CHECKING:
    from lmstack.memory.recommend import Candidate, PlanRequest

# YAML values for each DeepSpeed template: names of the templates shipped in lmstack/launch/templates/
# (LF's examples/deepspeed files; z1 is lmstack's own), found from any working directory.
DEEPSPEED_CONFIGS = {
    (0, False, False): "z0",
    (1, False, False): "z1",
    (2, False, False): "z2",
    (2, True, False): "z2_offload",
    (3, False, False): "z3",
    (3, True, True): "z3_offload",
}
FSDP_YAML = {"FULL_SHARD": "full_shard auto_wrap", "SHARD_GRAD_OP": "shard_grad_op auto_wrap"}

# a method change (QLoRA) wins over a fitting setup of the configured method only when at least this
# much faster: it changes what is trained (a 4-bit base), so a small speed-up does not pay for it
METHOD_CHANGE_MIN_SPEEDUP = 1.5
# bytes per parameter of one saved checkpoint (Trainer: weights + optimizer.pt; LoRA: the adapter)
CHECKPOINT_FULL_BYTES = 2 + 12  # bf16 weights + fp32 master, Adam m + v
CHECKPOINT_ADAPTER_BYTES = 4 + 8  # adapter weights + Adam m + v
PACKAGE_FOR = {"deepspeed": "deepspeed", "qlora": "bitsandbytes", "liger": "liger_kernel", "fp8": "torchao"}
# what to pip-install on the target for a module a row needs (fp8 through lmstack's extra: its pinned torchao)
PIP_FOR = {
    "deepspeed": "deepspeed",
    "bitsandbytes": "bitsandbytes",
    "liger_kernel": "liger-kernel",
    "torchao": "lmstack[fp8]",
    "flash_attn": "flash-attn",
    "flash_attn_interface": "flash-attn-3",
    "unsloth": "lmstack[unsloth]",
}


def target_installs(req: PlanRequest, s: Setup) -> tuple[str, ...]:
    """The pip requirements the target needs for setup `s` (the planner assumes it has them; `lmstack
    train` there refuses a missing one): the row's strategy (ZeRO, QLoRA, Liger, FP8 full) and what the
    YAML itself names (req.yaml_packages: flash-attn, Unsloth)."""
    need = list(req.yaml_packages)
    if s.deepspeed_stage is not None:
        need.append("deepspeed")
    if s.quantization_bit:
        need.append("bitsandbytes")
    if s.fused_ce if s.liger is None else s.liger:  # Liger's kernel set (estimate._liger), not the chunked CE
        need.append("liger_kernel")
    if s.fp8 == "float8-training":
        need.append("torchao")
    return tuple(dict.fromkeys(PIP_FOR[n] for n in need if n in PIP_FOR))


def unsupported(req: PlanRequest, s: Setup) -> str:
    """Why this machine / this stage cannot run `s` ('' when it can): the rules `lmstack check` and
    `lmstack train` apply (plan/rules.py, models/quantization.py)."""
    have = req.available
    if s.deepspeed_stage is not None and have is not None and PACKAGE_FOR["deepspeed"] not in have:
        return "unsupported here: DeepSpeed is not installed (pip install deepspeed)"
    if s.quantization_bit and have is not None and PACKAGE_FOR["qlora"] not in have:
        return "unsupported here: quantization needs bitsandbytes (pip install bitsandbytes)"
    if s.checkpoint_offload and (s.deepspeed_stage == 3 or s.fsdp):
        return (
            "unsupported combination: offloaded checkpointing (use_unsloth_gc) runs with DDP or ZeRO-1/2 only"
        )
    if s.quantization_bit == 8 and (s.deepspeed_stage == 3 or s.fsdp):
        return "unsupported combination: 8-bit bases cannot be sharded by ZeRO-3/FSDP"
    if not req.multi_process and (s.deepspeed_stage is not None or s.fsdp or s.num_gpus > 1):
        return f"unsupported combination: stage {req.stage} runs in one process (no DeepSpeed/FSDP)"
    if req.master_weights == "optimizer" and not own_masters(s) and s.optimizer_batch > s.micro_batch:
        return "unsupported combination: master_weights: optimizer needs gradient_accumulation_steps: 1"
    if s.fused_ce and have is not None and PACKAGE_FOR["liger"] not in have and not req.fused_ce:
        return "unsupported here: Liger's kernels need liger-kernel (pip install liger-kernel)"
    return _fp8_unsupported(req, s) if s.fp8 else ""


def own_masters(s: Setup) -> bool:
    """DeepSpeed (ZeRO-0 too) and FSDP keep their own fp32 masters; LoRA's adapters have none: the
    optimizer-held masters (master_weights: optimizer) never apply to such a row."""
    return s.deepspeed_stage is not None or s.fsdp is not None or s.finetuning_type == "lora"


def _fp8_unsupported(req: PlanRequest, s: Setup) -> str:
    """plan/rules.py's fp8 refusals (fp8_combinations, fp8_hardware, fp8_torchao) for an FP8 row."""
    if req.fp8_refused:
        return f"unsupported: {req.fp8_refused}"
    if s.deepspeed_stage is not None:
        return "unsupported combination: fp8 with DeepSpeed (not verified with lmstack's FP8 layers)"
    if s.fsdp and s.finetuning_type == "lora":
        return "unsupported combination: fp8 LoRA under FSDP (lmstack does not shard the FP8 frozen base)"
    if s.quantization_bit is not None:
        return (
            "unsupported combination: fp8 with quantization_bit (the base is bitsandbytes-quantized or FP8)"
        )
    if s.fp8 == "float8-training" and req.available is not None and PACKAGE_FOR["fp8"] not in req.available:
        return "unsupported here: fp8 full fine-tuning uses torchao (pip install 'lmstack[fp8]')"
    return ""


def checkpoint_gib(spec: ModelSpec, s: Setup) -> float:
    """Disk for one saved checkpoint: the weights and optimizer states, or LoRA's adapter."""
    if s.finetuning_type == "lora":
        return CHECKPOINT_ADAPTER_BYTES * spec.lora_params(s.lora_rank, s.lora_target) / mem.GIB
    return CHECKPOINT_FULL_BYTES * spec.num_params / mem.GIB


def yaml_changes(req: PlanRequest, c: Candidate) -> dict[str, object]:
    """The YAML fields to set so the training run matches candidate ``c``."""
    s, ch = c.setup, {}
    key = (s.deepspeed_stage, s.offload_optimizer, s.offload_param)
    if s.deepspeed_stage is not None and key == (
        req.deepspeed_stage,
        req.offload_optimizer,
        req.offload_param,
    ):
        pass  # the configured DeepSpeed file already is this strategy: nothing to change
    elif s.deepspeed_stage is not None:
        ch["deepspeed"] = DEEPSPEED_CONFIGS.get(key, f"<ZeRO-{key[0]} config with offload {key[1:]}>")
    elif req.deepspeed_stage is not None:
        ch["deepspeed"] = None
    if s.fsdp and not req.fsdp:
        ch["fsdp"] = FSDP_YAML[s.fsdp]
    elif req.fsdp and not s.fsdp:
        ch["fsdp"] = None
    if s.checkpoint_layers is not None:  # partial: no YAML field names k, the planner picks it under auto
        if req.gradient_checkpointing is not None:
            ch["gradient_checkpointing"] = "auto"
    elif req.gradient_checkpointing != s.gradient_checkpointing:
        ch["gradient_checkpointing"] = s.gradient_checkpointing
    if req.checkpoint_offload != s.checkpoint_offload:
        ch["use_unsloth_gc"] = s.checkpoint_offload
    if s.gradient_checkpointing and req.checkpointing_disabled:  # else LF's switch keeps it off
        ch["disable_gradient_checkpointing"] = False
    if req.micro_batch != s.micro_batch:
        ch["per_device_train_batch_size"] = s.micro_batch
        if req.micro_batch:  # the batch the optimizer sees stays micro_batch x gradient_accumulation_steps
            steps = req.micro_batch * req.gradient_accumulation_steps // s.micro_batch
            if steps != req.gradient_accumulation_steps:
                ch["gradient_accumulation_steps"] = steps
    if bool(req.fused_ce) != s.fused_ce:
        ch["enable_liger_kernel"] = s.fused_ce
    if req.attention != s.attention:
        # only sdpa is ever searched (from eager); fa2 would be refused where flash-attn is missing
        ch["flash_attn"] = {"flash": "fa2", "eager": "disabled"}.get(s.attention, s.attention)
    if s.finetuning_type != req.finetuning_type:
        ch.update(finetuning_type="lora", lora_rank=s.lora_rank, lora_target="all")
    if s.quantization_bit != req.quantization_bit:
        ch["quantization_bit"] = s.quantization_bit
    if s.optimizer != req.optimizer:
        ch[f"use_{req.optimizer}"] = False
    if (s.fp8 is None) != (req.fp8 is None):
        ch["fp8"] = s.fp8 is not None
    if req.master_weights == "optimizer" and own_masters(s):  # plan/decide.py refuses the masters there
        ch["master_weights"] = "auto"
    return ch


def ckpt_cell(s: Setup, layers: int, short: bool = False) -> str:
    """off | on | offloaded | k/N (partial: k of the N decoder layers recompute) | k/N offload; `short`:
    "offload" for the table's column."""
    if s.checkpoint_layers is not None:
        return f"{s.checkpoint_layers}/{layers}" + (" offload" if s.checkpoint_offload else "")
    offloaded = "offload" if short else "offloaded"
    return offloaded if s.checkpoint_offload else "on" if s.gradient_checkpointing else "off"


def label(c: Candidate, layers: int) -> str:
    s = c.setup
    bits = [c.strategy.name, f"micro-batch {s.micro_batch}", f"checkpointing {ckpt_cell(s, layers)}"]
    if s.fused_ce:
        bits.append("fused CE")
    if s.fp8:
        bits.append(f"fp8 {s.fp8}")
    return ", ".join(bits)


def reason(
    req: PlanRequest, rec: Candidate, same_method_best: dict[str, Candidate], same: Candidate | None
) -> str:
    usable, layers = req.gpu_memory_gib * mem.SAFETY_MARGIN, req.spec.num_layers
    text = (
        f"{label(rec, layers)} is the fastest setup that fits: it needs {rec.estimate.gpu.total:.1f} GiB per GPU "
        f"of the {usable:.1f} GiB usable ({req.gpu_memory_gib:g} GiB x {mem.SAFETY_MARGIN})"
        f", at a rough relative step cost of {rec.cost:.2f}."
    )
    k = rec.setup.checkpoint_layers
    if k is not None:  # partial: what k of the N layers costs and who picks k
        extra = f"~{33 * k / layers:.0f}% more compute"
        kept = f"the last {layers - k} keep their activations"
        picks = "gradient_checkpointing: auto picks this count when training starts"
    if rec.setup.checkpoint_offload:
        which = "each layer's forward (~33% more compute)"
        if k is not None:
            which = f"the forward of {k} of the {layers} decoder layers, the smallest count that fits ({extra}; {kept}; {picks})"
        text += (
            f" Gradient checkpointing is on with the layer inputs offloaded (use_unsloth_gc): it re-runs {which} "
            f"and parks {rec.estimate.offloaded_activations_gib:.1f} GiB of layer inputs in CPU RAM per node, "
            "copied over PCIe alongside the compute (its cost is an estimate)."
        )
    elif k is not None:
        text += (
            f" Gradient checkpointing on {k} of the {layers} decoder layers, the smallest count that fits: it "
            f"re-runs only those layers' forward ({extra}); {kept}. {picks}."
        )
    elif rec.setup.gradient_checkpointing:
        text += " Gradient checkpointing is on: it re-runs each layer's forward (~33% more compute)."
    else:
        text += " Activations fit without gradient checkpointing, so no recompute cost."
    if rec.setup.offload_optimizer:
        text += f" Offload needs about {rec.estimate.cpu_gib:.0f} GiB of CPU memory per node."
    if rec.setup.fp8 and not req.fp8:
        text += (
            f" fp8: true is a setting, not a method change: the {rec.setup.fp8} scope runs the large GEMMs in "
            "FP8 (the cost model's FP8 speed is a first figure from GEMM measurements, plan/fp8_estimate.py)."
        )
    tighter = [f"{n} ({c.why_not})" for n, c in same_method_best.items() if not c.fits]
    if tighter:
        text += " Did not fit: " + "; ".join(tighter[:4]) + "."
    if rec.changes_method:
        was = f"{req.finetuning_type}{'' if req.quantization_bit is None else f' {req.quantization_bit}-bit'}"
        why = (
            "nothing fits with the configured method on this hardware"
            if same is None
            else f"the best setup of the configured method ({label(same, layers)}) costs {same.cost:.2f}, "
            f">= {METHOD_CHANGE_MIN_SPEEDUP}x this one"
        )
        text += f" THIS CHANGES THE METHOD ({was} -> {rec.strategy.method}): {why}."
    return text
