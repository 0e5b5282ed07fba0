"""What happens when several accelerations are switched on at once (the conflict rules of the acceleration plug-ins), as rules over
the run plan. Each rule returns nothing (fine) or a note (a documented fallback, said once), or raises
ConfigError (unsupported). RULES is the one registry; `check_rules(plan)` runs them
all and reports every problem at once."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from typing import TYPE_CHECKING

from lmstack.config.errors import ConfigError
from lmstack.config.schema import ADAMW_OPTIMS
from lmstack.plan.decide_kernels import UNSLOTH_METHODS, UNSLOTH_STAGES
from lmstack.plan.rules_launch import deepspeed_installed, ray_installed, ray_launch
from lmstack.plan.rules_speed import (  # the FP8 / compile rules, in the tables below (and asked by name)
    compile_fields,
    fp8_all_gather,
    fp8_combinations,
    fp8_hardware,
    fp8_torchao,
)

if TYPE_CHECKING:  # annotations only: the planner's request (plan/from_config.py) asks these rules too
    from lmstack.plan.runplan import RunPlan

BNB_MIN_FOR_ZERO3 = (0, 43, 0)
FSDP_WORDS = (
    "full_shard",
    "shard_grad_op",
    "hybrid_shard",
    "hybrid_shard_zero2",
    "no_shard",
    "offload",
    "auto_wrap",
)

Rule = Callable[["RunPlan"], str | None]


def unsloth_supported(plan: RunPlan) -> str | None:
    """use_unsloth on what Unsloth has a path for in lmstack: pt/sft, LoRA (QLoRA 4/8-bit) or full."""
    cfg = plan.cfg
    if not cfg.model.use_unsloth:
        return None
    problems = []
    if cfg.finetuning.stage not in UNSLOTH_STAGES:
        problems.append(
            f"stage {cfg.finetuning.stage} (lmstack loads through Unsloth for {'/'.join(UNSLOTH_STAGES)})"
        )
    if cfg.finetuning.finetuning_type not in UNSLOTH_METHODS:
        problems.append(f"finetuning_type {cfg.finetuning.finetuning_type} (Unsloth trains LoRA or full)")
    if cfg.finetuning.use_dora:
        problems.append("use_dora (Unsloth's LoRA kernels are plain LoRA)")
    if cfg.model.adapter_name_or_path:
        problems.append("adapter_name_or_path (lmstack starts Unsloth's LoRA fresh)")
    if cfg.model.train_from_scratch:
        problems.append("train_from_scratch (Unsloth loads pretrained weights)")
    from lmstack.models.vision import vision_model_type

    if vision_model_type(cfg.model.model_name_or_path):
        problems.append("a vision-language model (lmstack loads those through transformers, not Unsloth)")
    if problems:
        raise ConfigError(
            "use_unsloth: true does not support "
            + "; ".join(problems)
            + ". Remove use_unsloth (lmstack's own "
            "kernels run instead) or change those fields"
        )
    return None


def unsloth_installed(plan: RunPlan) -> str | None:
    """This machine can run Unsloth: the package and a CUDA GPU (the multi-GPU fallback needs neither)."""
    if not plan.cfg.model.use_unsloth or plan.reasons.get("unsloth", "").startswith("use_unsloth: ignored"):
        return None
    if plan.device != "cuda":
        raise ConfigError(
            "use_unsloth: true needs a CUDA GPU (Unsloth's kernels are Triton); remove use_unsloth"
        )
    if not plan.ctx.has("unsloth"):
        raise ConfigError(
            "use_unsloth: true needs the unsloth package, which is not installed: pip install 'lmstack[unsloth]' "
            "(it pins its own trl/datasets/transformers versions), or remove use_unsloth"
        )
    return None


def fsdp_with_deepspeed(plan: RunPlan) -> str | None:
    if plan.fsdp is not None and plan.deepspeed is not None:
        how = (
            "accelerate launched this job with an FSDP config"
            if plan.fsdp.source == "accelerate"
            else (f"fsdp: {plan.cfg.training.fsdp!r} is set")
        )
        raise ConfigError(
            f"deepspeed: {plan.deepspeed.ref} was given, but {how}; use one of them: remove `deepspeed:` "
            "from the YAML, or drop FSDP"
        )
    return None


def fsdp_field(plan: RunPlan) -> str | None:
    t = plan.cfg.training
    if t.fsdp_config and not t.fsdp:
        raise ConfigError(
            "fsdp_config: only used with fsdp; set fsdp (e.g. 'full_shard auto_wrap') or remove it"
        )
    if not t.fsdp:
        return None
    unknown = [w for w in t.fsdp.split() if w not in FSDP_WORDS]
    if unknown:
        raise ConfigError(f"fsdp: unknown option {unknown[0]!r}; allowed words: {' | '.join(FSDP_WORDS)}")
    return None


def fsdp_processes(plan: RunPlan) -> str | None:
    t = plan.cfg.training
    if t.fsdp and plan.world_size < 2:
        raise ConfigError(
            f"fsdp: {t.fsdp!r} shards over several processes, and this run has one; launch it on several "
            "GPUs (lmstack train relaunches under torchrun), with FORCE_TORCHRUN=1 NPROC_PER_NODE=N, or "
            "remove fsdp"
        )
    return None


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def qlora_with_zero3(plan: RunPlan) -> str | None:
    bits = plan.cfg.model.quantization_bit
    if bits is None or plan.zero_stage != 3:
        return None
    need = ".".join(map(str, BNB_MIN_FOR_ZERO3))
    if not plan.ctx.has("bitsandbytes"):
        raise ConfigError(
            f"quantization_bit: {bits} with ZeRO-3 ({plan.deepspeed.ref}) needs "
            f"bitsandbytes >= {need}; pip install 'bitsandbytes>={need}'"
        )
    have = importlib.metadata.version("bitsandbytes")
    if _version_tuple(have) < BNB_MIN_FOR_ZERO3:
        raise ConfigError(
            f"quantization_bit: {bits} with ZeRO-3 needs bitsandbytes >= {need} "
            f"(installed: {have}); pip install -U 'bitsandbytes>={need}'"
        )
    return None


def single_process_stage(plan: RunPlan) -> str | None:
    if not plan.stage.multi_process and (plan.deepspeed is not None or plan.world_size > 1):
        raise ConfigError(
            f"stage: {plan.stage.name} runs in one process on one device (lmstack's compact PPO has no "
            "DeepSpeed or multi-GPU path yet); remove deepspeed and launch without torchrun, or use stage: grpo"
        )
    return None


def own_loop_optimizer(plan: RunPlan) -> str | None:
    optim = plan.cfg.training.optim
    if not plan.stage.trainer and optim not in ADAMW_OPTIMS:  # a stage's own loop builds torch's AdamW
        raise ConfigError(
            f"optim: {optim} is not available for stage: {plan.stage.name}, whose own training loop builds "
            f"torch's AdamW; use optim: {' or '.join(ADAMW_OPTIMS)}"
        )
    return None


def accuracy_stage(plan: RunPlan) -> str | None:
    """compute_accuracy is honoured only where the stage's trainer computes token accuracy
    (StageSpec.eval_accuracy). Elsewhere it has no effect, as in LLaMA-Factory (which reads it in sft
    only): a note said once, so an LF YAML still runs and the user learns no accuracy is reported."""
    if plan.cfg.finetuning.compute_accuracy and not plan.stage.eval_accuracy:
        from lmstack.config.stages import stages_where

        own = " (it reports its own pairwise eval_accuracy)" if plan.stage.name == "rm" else ""
        return (
            f"compute_accuracy: has no effect for stage {plan.stage.name}{own}; token accuracy at "
            f"evaluation is reported by stages {' and '.join(stages_where('eval_accuracy'))}"
        )
    return None


def padding_in_the_loss(plan: RunPlan) -> str | None:
    if not plan.cfg.data.ignore_pad_token_for_loss:
        raise ConfigError(
            "ignore_pad_token_for_loss: false (train on padding positions) is not available in lmstack; "
            "padding never counts in the loss here — remove the field"
        )
    return None


def upcast_layernorm(plan: RunPlan) -> str | None:
    p = plan.precision
    if plan.cfg.model.upcast_layernorm and p.autocast is None and p.load != "fp32":
        raise ConfigError(
            f"upcast_layernorm: fp32 norm weights in a {p.load} model need mixed precision to cast back; "
            "set bf16: true (or fp16), or remove upcast_layernorm"
        )
    return None


def _default(name: str) -> object:
    from lmstack.config.schema import FinetuningArgs

    return FinetuningArgs.model_fields[name].default


def rl_fields(plan: RunPlan) -> str | None:
    """The online-RL knobs (grpo / rloo, TRL's GRPOConfig names): a note where the stage has no use for
    them, a refusal where rloo would run its own loss instead of the one asked for, pref_beta: 0 where a
    preference loss needs beta > 0."""
    from lmstack.plan.decide_rl import GRPO_ONLY, RL_KNOBS, RL_STAGES

    ft, stage = plan.cfg.finetuning, plan.stage.name
    changed = [n for n in RL_KNOBS if getattr(ft, n) != _default(n)]
    notes = []
    if ft.pref_beta == 0 and stage in ("dpo", "kto"):
        raise ConfigError(
            f"pref_beta: 0 leaves stage {stage} without a loss (beta scales every log-ratio in it); "
            "use a beta > 0 such as LLaMA-Factory's 0.1 (0 turns off the KL only in grpo/rloo)"
        )
    if stage == "ppo" and ft.pref_beta != _default("pref_beta"):
        notes.append(
            f"pref_beta: {ft.pref_beta} has no effect for stage ppo (its KL weight is the adaptive "
            "kl_coef that follows ppo_target); it applies to dpo / kto / orpo / simpo / grpo / rloo"
        )
    if stage not in RL_STAGES:
        if changed:
            notes.append(
                f"{', '.join(changed)}: no effect for stage {stage} (online-RL settings of stage grpo / rloo)"
            )
    elif stage == "rloo" and (grpo_only := [n for n in GRPO_ONLY if n in changed]):
        raise ConfigError(
            f"{grpo_only[0]}: {getattr(ft, grpo_only[0])} is a stage grpo setting; RLOO's loss is its own "
            "(sequence-level ratio, averaged over answers; ppo_score_norm normalises its advantages): "
            f"remove {' and '.join(grpo_only)} or use stage: grpo"
        )
    elif ft.importance_sampling_level == "sequence" and ft.loss_type != "grpo":
        notes.append(
            f"importance_sampling_level: sequence with loss_type: {ft.loss_type} sums token terms, weighting "
            "each answer by its length; GSPO's per-answer objective is loss_type: grpo"
        )
    if ft.max_tool_calling_iterations is not None and not ft.tool_funcs and stage in RL_STAGES:
        notes.append("max_tool_calling_iterations: no effect without tool_funcs")
    uses_format = "format" in [s.strip() for s in (ft.reward_funcs or "").split(",")]
    if ft.format_reward_pattern != _default("format_reward_pattern"):
        import re

        if not uses_format:
            notes.append("format_reward_pattern: no effect without `format` in reward_funcs")
        try:
            re.compile(ft.format_reward_pattern)
        except re.error as err:
            raise ConfigError(
                f"format_reward_pattern: {ft.format_reward_pattern!r} is not a regular expression ({err}); "
                r"fix it, e.g. '^<think>.*?</think>\s*<answer>.*?</answer>$'"
            ) from None
    return "; ".join(notes) or None


CHECKPOINT_KEYS = ("use_reentrant", "preserve_rng_state", "determinism_check", "debug", "early_stop")
NON_REENTRANT_KEYS = ("determinism_check", "debug", "early_stop")


def checkpointing_kwargs(plan: RunPlan) -> str | None:
    kwargs = plan.cfg.training.gradient_checkpointing_kwargs
    if not kwargs:
        return None
    unknown = [k for k in kwargs if k not in CHECKPOINT_KEYS]
    if unknown:
        raise ConfigError(
            f"gradient_checkpointing_kwargs: unknown key {unknown[0]!r}; torch.utils.checkpoint takes "
            f"{' | '.join(CHECKPOINT_KEYS)}"
        )
    reentrant = kwargs.get("use_reentrant", plan.cfg.model.use_reentrant_gc)
    needs_new = [k for k in kwargs if k in NON_REENTRANT_KEYS]
    if reentrant and needs_new:
        raise ConfigError(
            f"gradient_checkpointing_kwargs: {needs_new[0]} works with non-reentrant checkpointing only; "
            "add use_reentrant: false to gradient_checkpointing_kwargs"
        )
    if not plan.checkpointing:
        return (
            f"gradient_checkpointing_kwargs: has no effect, this run does not recompute activations "
            f"({plan.reasons.get('checkpointing', 'checkpointing off')})"
        )
    return None


def sharded_generation(plan: RunPlan) -> str | None:
    t = plan.cfg.training
    if t.do_predict and t.predict_with_generate and plan.sharded:
        raise ConfigError(
            "predict_with_generate: generation needs the whole model in each process, and ZeRO-3 / FSDP "
            "shard it (LLaMA-Factory refuses ZeRO-3 too); predict in a run without deepspeed ZeRO-3 / fsdp"
        )
    return None


def sharded_asft_reference(plan: RunPlan) -> str | None:
    ft = plan.cfg.finetuning
    separate = ft.ref_model is not None or ft.finetuning_type in ("full", "freeze")
    if ft.use_asft_loss and separate and plan.sharded:
        raise ConfigError(
            "use_asft_loss: its frozen reference model (ref_model, or the copy full/freeze tuning needs) is not "
            "sharded by lmstack under ZeRO-3 / FSDP yet; use finetuning_type: lora without ref_model (the "
            "adapter-off base is the reference) or ZeRO-2"
        )
    return None


def infer_backend_for_training(plan: RunPlan) -> str | None:
    backend = plan.cfg.model.infer_backend
    if backend != "huggingface":  # as in LLaMA-Factory: training and evaluation run on transformers
        raise ConfigError(
            f"infer_backend: {backend} serves chat/api only; train and eval need infer_backend: huggingface "
            "(remove it from the training YAML, or set it on the lmstack api / chat command line)"
        )
    return None


RULES: list[Rule] = [
    infer_backend_for_training,
    fp8_all_gather,
    fp8_combinations,
    compile_fields,
    checkpointing_kwargs,
    sharded_generation,
    sharded_asft_reference,
    padding_in_the_loss,
    upcast_layernorm,
    unsloth_supported,
    fsdp_with_deepspeed,
    fsdp_field,
    qlora_with_zero3,
    single_process_stage,
    own_loop_optimizer,
    accuracy_stage,
    rl_fields,
    # GaLore / APOLLO / BAdam combinations are checked by train/method_rules.py
]
# rules about this machine and this launch: `lmstack train` applies them, `lmstack check` (which may
# run on another machine than the job) does not
LAUNCH_RULES: list[Rule] = [
    ray_launch,
    ray_installed,
    fsdp_processes,
    deepspeed_installed,
    unsloth_installed,
    fp8_hardware,
    fp8_torchao,
]


def check_rules(plan: RunPlan, launch: bool = True) -> tuple[list[str], list[str]]:
    """Run every rule; returns (notes of the fallbacks applied, problems). Never stops at the first."""
    notes, problems = list(plan.notes), []
    for rule in RULES + (LAUNCH_RULES if launch else []):
        try:
            note = rule(plan)
        except ConfigError as err:
            problems.append(str(err))
            continue
        if note:
            notes.append(note)
    return notes, problems
