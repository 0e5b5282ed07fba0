"""Bridge from a training `Config` / `RunPlan` to a `PlanRequest` (reads config.json only, never weights)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmstack.config.schema import Config
from lmstack.memory.model_spec import ModelSpec
from lmstack.memory.recommend import PlanRequest

if TYPE_CHECKING:
    from lmstack.plan.lengths import DataLengths
    from lmstack.plan.runplan import RunPlan


FLASH_CLASS = {"flash_attention_2", "flash_attention_3", "flex_attention"}


def _attention(plan: RunPlan) -> str:
    """The planner's attention class for the plan's attn_implementation (no T x T scores for flash)."""
    if plan.attention in FLASH_CLASS:
        return "flash"
    return "eager" if plan.attention == "eager" else "sdpa"


def _optimizer(cfg: Config) -> str:
    """use_galore | use_apollo | use_badam | use_muon (or optim: muon) -> the planner's optimizer name."""
    ft = cfg.finetuning
    for name, on in (("galore", ft.use_galore), ("apollo", ft.use_apollo), ("badam", ft.use_badam)):
        if on:
            return name
    return "muon" if ft.use_muon or cfg.training.optim == "muon" else "adamw"


def _adapter_setup(cfg: Config) -> tuple[str, int, str]:
    """(finetuning_type, rank, target) as the memory model sees them: OFT is an adapter method like LoRA;
    its rotation blocks hold in x (b - 1) / 2 parameters per linear layer (b = oft_block_size), about
    what a LoRA of rank (b - 1) / 4 holds on a square layer (rank x (in + out))."""
    ft = cfg.finetuning
    if ft.finetuning_type != "oft":
        return ft.finetuning_type, ft.lora_rank, ft.lora_target
    if ft.oft_block_size:
        return "lora", max(1, round((ft.oft_block_size - 1) / 4)), ft.oft_target
    return "lora", max(1, ft.oft_rank), ft.oft_target  # r blocks: in x (in / r - 1) / 2, taken as rank r


def _logit_loss(cfg: Config) -> bool:
    """A custom token loss (DFT/EAFT/ASFT) is on: the logits are materialised whatever ZeRO stage."""
    from lmstack.plan.decide_kernels import LOGIT_LOSSES

    return any(getattr(cfg.finetuning, name) for name in LOGIT_LOSSES)


def _reference(cfg: Config) -> str:
    """train/rlhf.reference_model: ref_model or full/freeze tuning -> a frozen copy; LoRA -> adapter off."""
    ft = cfg.finetuning
    return "copy" if ft.ref_model or ft.finetuning_type != "lora" else "adapter_off"


def stage_fields(plan: RunPlan, spec: ModelSpec) -> dict:
    """The stage's shape for the memory model (plan/stage_memory.py says what each trainer holds)."""
    from lmstack.memory.stage_memory import REFERENCE_FREE_LOSSES

    cfg = plan.cfg
    ft, t, stage = cfg.finetuning, cfg.training, cfg.finetuning.stage
    out: dict = {"stage": stage, "packed": plan.packing, "expandable_segments": plan.allocator.expandable}
    if stage == "dpo":
        free = ft.pref_loss in REFERENCE_FREE_LOSSES
        loss = "trl_logprob"
        if free:  # SimPO runs TRL's CPO with cpo_alpha = pref_ftx: no NLL term when it is 0
            loss = "full_logits_no_nll" if ft.pref_loss == "simpo" and not ft.pref_ftx else "full_logits"
        out.update(rows_per_example=2, loss_path=loss,
                   reference="none" if free else _reference(cfg))  # fmt: skip
    elif stage == "kto":
        out.update(loss_path="trl_logprob", reference=_reference(cfg), kl_batch=True)
    elif stage == "rm":
        out.update(rows_per_example=2, loss_path="value_head")
    elif stage in ("grpo", "rloo", "ppo"):
        prompt, answer = cfg.data.cutoff_len, cfg.generating.max_new_tokens
        per_step = plan.micro_batch * t.gradient_accumulation_steps  # TRL: steps_per_generation = GAS
        out.update(prompt_len=prompt, seq_len=prompt + answer, generated_rows=per_step)
        if stage == "ppo":
            out.update(loss_path="full_logits", reference=_reference(cfg),
                       generated_rows=per_step * ft.ppo_buffer_size,
                       reward_model_params=spec.num_params if ft.reward_model else 0)  # fmt: skip
        else:
            kl_copy = ft.pref_beta > 0 and ft.finetuning_type != "lora"
            out.update(loss_path="trl_logprob", reference="copy" if kl_copy else "none")
    return out


SIZED_FREEZE_EXTRA_MODULES = ("embed_tokens", "lm_head", "norm")  # estimate.freeze_extra_params


def _unmodelled(cfg: Config) -> tuple[str, ...]:
    """Terms the memory model does not count for this run (a note in the table, never silence)."""
    from lmstack.models.adapters import freeze_extra_modules
    from lmstack.models.vision import vision_model_type

    ft = cfg.finetuning
    unsized = [m for m in freeze_extra_modules(cfg) if m not in SIZED_FREEZE_EXTRA_MODULES]
    notes = (
        (
            f"freeze_extra_modules: {', '.join(unsized)} not sized by the planner (it sizes "
            f"{', '.join(SIZED_FREEZE_EXTRA_MODULES)}): their gradients and optimizer states are not counted",
        )
        if unsized
        else ()
    )
    if not vision_model_type(cfg.model.model_name_or_path):
        return notes
    trains = [
        name
        for name, on in (
            ("freeze_vision_tower: false", not ft.freeze_vision_tower),
            ("freeze_multi_modal_projector: false", not ft.freeze_multi_modal_projector),
            ("freeze_language_model: true (LoRA moves to the vision blocks)", ft.freeze_language_model),
        )
        if on
    ]
    if not trains:  # a frozen tower saves no activations for backward: its peak is one block, transient
        return notes
    return notes + (
        f"vision model with {', '.join(trains)}: the vision tower's saved activations (per image patch, per "
        "vision block) are not modelled; the real peak is higher than shown",
    )


def fp8_fields(plan: RunPlan) -> dict:
    """The request's FP8 facts, from the plan's own decision (decide_kernels.fp8) and rules (plan/rules.py): the
    configured scope; the scope `fp8: true` gives this config and, where the rules refuse it for this method
    or this GPU (DeepSpeed and FSDP are the search's to change), why."""
    from dataclasses import replace

    from lmstack.config.errors import ConfigError
    from lmstack.plan import decide_kernels, rules

    cfg, ctx = plan.cfg, plan.ctx
    on = plan
    if not plan.fp8.enabled:
        fp8_cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"fp8": True})})
        on = replace(plan, cfg=fp8_cfg, fp8=decide_kernels.fp8(fp8_cfg))
    refused = ""
    try:
        rules.fp8_combinations(replace(on, deepspeed=None, fsdp=None))
        rules.fp8_hardware(on)
    except ConfigError as err:
        refused = str(err)
    return {
        "fp8": plan.fp8.scope if plan.fp8.enabled else None,
        "fp8_allowed": None if refused else on.fp8.scope,
        "fp8_refused": refused,
        "gpu_capability": ctx.cuda_capability,
        "gpu_name": ctx.gpu_name,
    }


def _single_process_scheme(plan: RunPlan) -> tuple[bool, bool]:
    """How a single/DDP row of this config would keep its fp32 master weights (decide.master_weights without
    ZeRO/FSDP), for the rows the planner searches beyond the configured strategy: (masters_unless_accumulating:
    master_weights: auto on a GPU and nothing but gradient accumulation blocks the optimizer-held masters,
    classic_amp_alone: a mixed-precision full/freeze run whose masters are blocked otherwise, or
    master_weights: model -- fp32 weights in the model whatever the accumulation)."""
    from lmstack.plan import decide

    cfg, t = plan.cfg, plan.cfg.training
    if plan.device != "cuda" or cfg.finetuning.finetuning_type not in ("full", "freeze"):
        return False, False
    # fp32 weights in the model need the model loaded in fp32: pure_bf16 and BAdam keep theirs in half
    # precision (decide.precision's keep_half), whatever blocks the masters
    mixed = (t.bf16 or t.fp16) and not cfg.finetuning.pure_bf16 and not cfg.finetuning.use_badam
    blockers = set(decide.master_weight_blockers(cfg, plan.stage, None, False))
    if t.master_weights == "auto" and blockers <= {"gradient_accumulation_steps: 1"}:
        return True, False
    return False, mixed and (t.master_weights == "model" or (t.master_weights == "auto" and bool(blockers)))


def yaml_packages(cfg) -> tuple[str, ...]:
    """Optional modules the YAML itself names (not a strategy's): flash-attn for fa2/fa3, Unsloth."""
    named = []
    if cfg.model.flash_attn in ("fa2", "fa3"):
        named.append("flash_attn" if cfg.model.flash_attn == "fa2" else "flash_attn_interface")
    if cfg.model.use_unsloth:
        named.append("unsloth")
    return tuple(named)


def request_from_plan(
    plan: RunPlan,
    gpus: int,
    gpu_memory_gib: float,
    nodes: int = 1,
    cpu_memory_gib: float | None = None,
    search: bool = False,
    lengths: DataLengths | None = None,
    available: frozenset[str] | None = None,
    disk_free_gib: float | None = None,
    interconnect: str | None = None,
) -> PlanRequest:
    """Every fact the memory model needs, read from the run plan (never re-derived from the YAML).
    `lengths`: the data's own row lengths (plan/lengths.py) for an unpacked run; None = cutoff_len.
    `available` / `disk_free_gib`: this machine's optional packages and free disk at output_dir (None: the
    recommendation assumes everything installed / does not check the disk); `interconnect`: the target
    GPUs' "nvlink" | "pcie" (memory/gpus.py), None where not known."""
    from lmstack.models.adapters import freeze_extra_modules

    cfg = plan.cfg
    spec = ModelSpec.from_pretrained_dir(cfg.model.model_name_or_path)
    t, ft = cfg.training, cfg.finetuning
    ds = plan.deepspeed
    mixed = plan.precision.autocast is not None
    kind, rank, target = _adapter_setup(cfg)
    fp32_weights = (
        kind != "lora" and ds is None and plan.fsdp is None and mixed
        and plan.precision.master_weights == "model" and plan.precision.load == "fp32"
    )  # fmt: skip
    # auto (the default): the planner decides; with use_unsloth_gc checkpointing stays on (LF), offloaded,
    # and auto decides how many layers recompute (recommend.search: the fewest that fit)
    gc_auto = t.gradient_checkpointing == "auto" and not cfg.model.disable_gradient_checkpointing
    masters_unless_accumulating, classic_amp_alone = _single_process_scheme(plan)
    fields = {"seq_len": plan.row_capacity or cfg.data.cutoff_len}
    fields.update(stage_fields(plan, spec))
    fields.update(fp8_fields(plan))
    fields["worst_seq_len"] = fields["seq_len"]
    if lengths is not None:
        fields["length_source"] = lengths.describe()
        if "prompt_len" in fields:  # prompt stages: the data rows are the prompts
            fields.update(prompt_len=lengths.bound, seq_len=lengths.bound + cfg.generating.max_new_tokens)
        else:
            fields["seq_len"] = lengths.bound
    return PlanRequest(
        **fields,
        unmodelled=_unmodelled(cfg),
        available=available,
        yaml_packages=yaml_packages(cfg),
        interconnect=interconnect,
        disk_free_gib=disk_free_gib,
        stage_fused_ce=plan.stage.fused_ce,
        multi_process=plan.stage.multi_process,
        spec=spec,
        finetuning_type=kind,
        lora_rank=rank,
        lora_target=target,
        quantization_bit=cfg.model.quantization_bit,
        micro_batch=None if (search or t.per_device_train_batch_size == "auto") else plan.micro_batch,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        gradient_checkpointing=None if (search or gc_auto) else plan.checkpointing,
        checkpoint_offload=plan.checkpoint_offload,
        # the plan's k (a resolved auto): the estimate is the run's own, not every layer's
        checkpoint_layers=None if (search or gc_auto) else plan.checkpoint_layers,
        checkpointing_disabled=cfg.model.disable_gradient_checkpointing,
        attention=_attention(plan),
        packing=plan.packing,
        fused_ce=plan.loss_kernel != "none"
        or (plan.stage.fused_ce and t.deepspeed == "auto" and not _logit_loss(cfg)),
        liger=plan.liger,
        fp32_model_weights=fp32_weights,
        fp32_adapters=kind == "lora" and plan.precision.compute == "fp32",
        num_gpus=gpus * nodes,
        gpu_memory_gib=gpu_memory_gib,
        nodes=nodes,
        cpu_memory_gib=cpu_memory_gib,
        pure_bf16=ft.pure_bf16,
        freeze_trainable_layers=ft.freeze_trainable_layers,
        llama_pro=ft.use_llama_pro,
        freeze_extra_modules=freeze_extra_modules(cfg),
        optimizer=_optimizer(cfg),
        adam_foreach=plan.optimizer == "adamw_torch",  # the plan's AdamW kernel (unset optim: fused)
        master_weights=t.master_weights,
        masters_unless_accumulating=masters_unless_accumulating,
        classic_amp_alone=classic_amp_alone,
        optimizer_rank=ft.apollo_rank if ft.use_apollo else ft.galore_rank,
        deepspeed_stage="auto" if t.deepspeed == "auto" else (ds.zero_stage if ds else None),
        offload_optimizer=bool(ds and ds.offload_optimizer),
        offload_param=bool(ds and ds.offload_param),
        fsdp=plan.fsdp is not None,
        fsdp_sharding=plan.fsdp.sharding
        if plan.fsdp and plan.fsdp.sharding == "SHARD_GRAD_OP"
        else "FULL_SHARD",
    )
