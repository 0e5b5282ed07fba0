"""`RunPlan.resolve(cfg, ctx)`: every derived decision of a training run, taken once, frozen, each
with the reason it was taken (DESIGN "The run plan: decide once, read everywhere").

The stages, the planner (`lmstack plan`), `lmstack check`, the launcher and the run manifest read the
same plan. `plan.cfg` is the user's config with the `auto` fields replaced by the planner's values
(a derived copy: the validated config itself is never mutated); the decisions below are what the
code reads instead of re-deriving them from the config.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

from lmstack.config.errors import ConfigError
from lmstack.config.schema import Config
from lmstack.config.stages import STAGE_SPECS, StageSpec, stage_spec
from lmstack.launch.context import LaunchContext
from lmstack.plan import decide, decide_host, decide_kernels, decide_rl

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeepSpeedPlan:
    ref: str  # what the YAML (or deepspeed: auto) named: a path or a template name
    config: dict  # validated JSON with lmstack's own "auto" values resolved (the Trainer fills the rest)
    zero_stage: int
    offload_optimizer: bool
    offload_param: bool


@dataclass(frozen=True)
class FsdpPlan:
    source: str  # "accelerate" (launched with an FSDP accelerate config) | "yaml" (the `fsdp` field)
    sharding: str  # FULL_SHARD | SHARD_GRAD_OP | NO_SHARD | HYBRID_SHARD
    version: int = 1


@dataclass(frozen=True)
class RayPlan:
    """USE_RAY=1 in the launching process: the job runs on Ray Train workers (launch/ray.py)."""

    num_workers: int
    init_kwargs: dict  # ray.init's keyword arguments (ray_init_kwargs; {} = ray.init())
    master_addr: str | None  # the node rank 0 is placed on (None: where Ray puts it)
    master_port: int | None  # None: a free port on rank 0's node
    use_gpu: bool  # one GPU per worker (NCCL), else one CPU per worker (gloo)


@dataclass(frozen=True)
class RunPlan:
    cfg: Config
    ctx: LaunchContext
    stage: StageSpec
    device: str
    precision: decide.Precision
    packing: bool
    row_capacity: int | None  # tokens per packed row (None: not packed)
    split_long_texts: bool  # pt on packed rows: long texts become cutoff_len pieces (nothing dropped)
    attention: str  # transformers' attn_implementation
    liger: bool
    unsloth: bool  # the model loads through Unsloth's FastLanguageModel (use_unsloth)
    loss_kernel: str  # liger | chunked | none
    lora_kernel: str  # fused | peft: how LoRA Linear layers compute
    fp8: decide_kernels.Fp8Plan  # which GEMMs run in FP8 (models/fp8.py)
    compile: decide_kernels.CompilePlan  # regional torch.compile of the decoder layers (models/compile.py)
    deepspeed: DeepSpeedPlan | None
    fsdp: FsdpPlan | None
    checkpointing: bool
    micro_batch: int
    world_size: int
    allocator: decide.AllocatorPlan  # the CUDA caching allocator's mode (expandable segments or default)
    loader: decide_host.LoaderPlan  # the DataLoader's worker processes (batches built off the step's path)
    optimizer: str  # the `optim` value the Trainer builds (LF's AdamW unset: torch's fused kernel)
    kept_out: tuple[str, ...]  # installed packages this run never imports (train/run.py keeps them out)
    reasons: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # documented fallbacks, said once (warnings)
    checkpoint_offload: bool = False  # the checkpointed layer inputs wait in CPU RAM (use_unsloth_gc)
    # with checkpointing: how many decoder layers recompute (the first ones; plan/partial_ckpt.py), chosen by
    # the planner under gradient_checkpointing: auto; None = every layer (an explicit true, use_unsloth_gc)
    checkpoint_layers: int | None = None
    rl: decide_rl.RLPlan | None = None  # grpo / rloo: loss, clip, advantage scaling, KL reference, rewards
    ray: RayPlan | None = None  # launched on Ray Train (USE_RAY=1), from this process

    @classmethod
    def resolve(cls, cfg: Config, ctx: LaunchContext, resolve_auto: bool = True) -> RunPlan:
        return _resolve(cfg, ctx, resolve_auto)

    @property
    def zero_stage(self) -> int | None:
        return None if self.deepspeed is None else self.deepspeed.zero_stage

    @property
    def is_main(self) -> bool:
        return self.ctx.is_main

    @property
    def sharded(self) -> bool:
        """Weights partitioned across processes (ZeRO-3 or FSDP)."""
        return self.zero_stage == 3 or self.fsdp is not None

    def model_spec(self, path: str | None = None) -> Any:
        """The load spec of the trained model (or, with `path`, of a frozen model from there)."""
        from lmstack.models.load import ModelLoadSpec, hub_kwargs, torch_dtype
        from lmstack.models.quantization import quantization_config, quantized_device_map

        m = self.cfg.model
        quant = quantization_config(self.cfg, torch_dtype(self.precision.compute))
        return ModelLoadSpec(
            path=path or m.model_name_or_path,
            hub=hub_kwargs(self.cfg),
            load_dtype=self.precision.load,
            compute_dtype=self.precision.compute,
            attention=self.attention,
            liger=self.liger,
            liger_fused_ce=self.loss_kernel == "liger",
            unsloth=self.unsloth and path is None,
            max_seq_length=self.cfg.data.cutoff_len,
            full_finetuning=self.cfg.finetuning.finetuning_type == "full",
            checkpointing=self.checkpointing,
            quantization_bit=m.quantization_bit,
            device_index=self.ctx.local_rank,
            quantization=quant,
            device_map=quantized_device_map(m.quantization_bit, self.sharded, self.ctx.local_rank),
            train_from_scratch=m.train_from_scratch and path is None,
            low_cpu_mem_usage=m.low_cpu_mem_usage,
            resize_vocab=m.resize_vocab,
            upcast_layernorm=m.upcast_layernorm,
            seed=self.cfg.training.seed,
        )

    def speedup_spec(self) -> Any:
        """What `apply_speedups` does to the trained model once its adapters are on: FP8, then compile."""
        from lmstack.models.load import SpeedupSpec

        f, c = self.fp8, self.compile
        return SpeedupSpec(
            fp8_scope=f.scope if f.enabled else None,
            fp8_recipe=f.recipe or "rowwise",
            fp8_all_gather=f.all_gather,
            device=f"cuda:{self.ctx.local_rank}" if self.device == "cuda" else None,
            compile_backend=c.backend if c.enabled else None,
            compile_dynamic=c.dynamic,
            compile_fullgraph=c.fullgraph,
        )

    def pack_spec(self, eval_split: bool = False) -> Any:
        from lmstack.data.packing import PackSpec

        t = self.cfg.training
        rows = t.per_device_eval_batch_size if eval_split else self.micro_batch
        return PackSpec(
            capacity=self.row_capacity or self.cfg.data.cutoff_len,
            seed=t.seed,
            rows_multiple=rows * self.world_size,
        )

    def decisions(self) -> dict[str, Any]:
        """name -> value of every decision (printed by `lmstack plan`/`check`, saved in the manifest)."""
        p = self.precision
        return {
            "stage": self.stage.name,
            "device": self.device,
            "world_size": self.world_size,
            "precision": p.compute,
            "load_dtype": p.load,
            "autocast": p.autocast,
            "master_weights": p.master_weights,
            "packing": self.packing,
            "row_capacity": self.row_capacity,
            "split_long_texts": self.split_long_texts,
            "attention": self.attention,
            "liger": self.liger,
            "unsloth": self.unsloth,
            "loss_kernel": self.loss_kernel,
            "lora_kernel": self.lora_kernel,
            "fp8": f"{self.fp8.scope} ({self.fp8.recipe})" if self.fp8.enabled else False,
            "compile": f"regional ({self.compile.backend})" if self.compile.enabled else False,
            "zero_stage": self.zero_stage,
            "deepspeed": self.deepspeed.ref if self.deepspeed else None,
            "fsdp": f"{self.fsdp.sharding} ({self.fsdp.source})" if self.fsdp else None,
            "checkpointing": self.checkpointing,
            "checkpoint_offload": self.checkpoint_offload,
            "checkpoint_layers": (self.checkpoint_layers or "all") if self.checkpointing else None,
            "micro_batch": self.micro_batch,
            "allocator": self.allocator.label,
            "data_workers": self.loader.workers,
            "optimizer": self.optimizer,
            "kept_out": ", ".join(self.kept_out) or None,
        } | ({"rl": self.rl.label()} if self.rl is not None else {})

    def to_dict(self) -> dict[str, Any]:
        return {"decisions": self.decisions(), "reasons": dict(self.reasons), "notes": list(self.notes)}

    def describe(self) -> str:
        lines = ["run plan (what this run does, and why):"]
        for name, value in self.decisions().items():
            why = self.reasons.get(name)
            lines.append(f"  {name:<17} {value!s:<22}" + (f" {why}" if why else ""))
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def ray_plan(cfg: Config, ctx: LaunchContext, device: str) -> RayPlan | None:
    """The Ray launch when this process starts one: USE_RAY=1 outside a launcher. A Ray worker (USE_RAY=1
    too, RANK/WORLD_SIZE set by launch/ray.py) runs the job as a torchrun worker does."""
    if not ctx.use_ray or ctx.under_launcher:
        return None
    t = cfg.training
    return RayPlan(
        num_workers=t.ray_num_workers,
        init_kwargs=dict(t.ray_init_kwargs or {}),
        master_addr=t.master_addr,
        master_port=t.master_port,
        use_gpu=device == "cuda",
    )


def deepspeed_plan(ref: str | None, bf16: bool, fp16: bool) -> DeepSpeedPlan | None:
    """The DeepSpeed JSON, read and validated once (a path or a shipped template name)."""
    if not ref:
        return None
    from lmstack.launch import deepspeed as ds

    config = ds.resolve_config(ds.load_deepspeed_config(ref), bf16=bf16, fp16=fp16)
    zero = config.get("zero_optimization") or {}

    def offloaded(key: str) -> bool:
        return str((zero.get(key) or {}).get("device", "none")).lower() not in ("none", "")

    return DeepSpeedPlan(
        ref, config, ds.zero_stage(config), offloaded("offload_optimizer"), offloaded("offload_param")
    )


FSDP_OPTIONS = {
    "full_shard": "FULL_SHARD",
    "shard_grad_op": "SHARD_GRAD_OP",
    "hybrid_shard": "HYBRID_SHARD",
    "no_shard": "NO_SHARD",
}


def fsdp_plan(cfg: Config, ctx: LaunchContext) -> FsdpPlan | None:
    value = cfg.training.fsdp
    if ctx.accelerate_fsdp is not None:
        if value:
            raise ConfigError(
                f"fsdp: {value!r} in the YAML, but accelerate already launched this job with an FSDP config; "
                "use one of them"
            )
        launch = ctx.accelerate_fsdp
        return FsdpPlan("accelerate", launch.sharding, launch.version)
    if not value:
        return None
    sharding = next((FSDP_OPTIONS[w] for w in value.split() if w in FSDP_OPTIONS), "FULL_SHARD")
    version = int((cfg.training.fsdp_config or {}).get("version", 1))
    return FsdpPlan("yaml", sharding, version)


def _resolve(cfg: Config, ctx: LaunchContext, resolve_auto: bool) -> RunPlan:
    """Without `auto` fields (or with resolve_auto=False) one pass; otherwise a draft plan sizes the
    auto fields with the planner and the final plan is resolved on the config holding their values."""
    if cfg.training.optim == "muon":  # `optim: muon` and LF's `use_muon: true` are one thing
        cfg = cfg.model_copy(
            update={
                "training": cfg.training.model_copy(update={"optim": "adamw_torch"}),
                "finetuning": cfg.finetuning.model_copy(update={"use_muon": True}),
            }
        )
    autos = [f for f in _AUTO if getattr(cfg.training, f) == "auto"]
    if not (resolve_auto and autos):
        return _resolve_once(cfg, ctx, cfg)
    from lmstack.plan.auto import auto_values

    draft = _resolve_once(cfg, ctx, cfg)
    chosen, message, fits = auto_values(draft)
    layers, layers_why = chosen.pop("checkpoint_layers", None), chosen.pop("checkpoint_layers_reason", "")
    resolved = cfg.model_copy(update={"training": cfg.training.model_copy(update=chosen)})
    plan = _resolve_once(resolved, ctx, cfg)
    plan.reasons["auto"] = message
    if layers is not None and plan.checkpointing:
        if plan.unsloth:  # Unsloth applies its own checkpointing to every layer at load
            layers_why = (
                f"all: Unsloth checkpoints every layer itself (the planner's choice was {layers_why})"
            )
            layers = None
        plan = replace(plan, checkpoint_layers=layers)
        plan.reasons["checkpoint_layers"] = layers_why
    if not fits:
        return replace(plan, notes=(*plan.notes, message))
    return plan


def _resolve_once(cfg: Config, ctx: LaunchContext, user: Config) -> RunPlan:
    t = cfg.training
    if cfg.finetuning.stage not in STAGE_SPECS:
        raise ConfigError(
            f"stage: {cfg.finetuning.stage!r} is not implemented; available: {' | '.join(STAGE_SPECS)}"
        )
    spec = stage_spec(cfg.finetuning.stage)
    dev, dev_why = decide.device(cfg, ctx)
    reasons: dict[str, str] = {"device": dev_why}
    notes: list[str] = []
    ray, world = ray_plan(cfg, ctx, dev), ctx.planned_world_size(dev == "cuda")
    if ray is not None:
        world = ray.num_workers
        reasons["world_size"] = (
            f"USE_RAY=1: ray_num_workers Ray Train workers, one {'GPU' if ray.use_gpu else 'CPU'} each"
        )
    fsdp = fsdp_plan(cfg, ctx)
    packed, reasons["packing"] = decide.packing(cfg, spec)
    attn, reasons["attention"] = decide.attention(cfg, ctx, dev, packed)
    use_liger, reasons["liger"] = decide.liger(cfg, ctx, dev)
    ds = deepspeed_plan(t.deepspeed if t.deepspeed != "auto" else None, t.bf16, t.fp16)
    zero = None if ds is None else ds.zero_stage
    distributed = (
        f"DeepSpeed ZeRO-{zero}"
        if ds is not None
        else "FSDP"
        if fsdp is not None
        else f"{world} processes"
        if world > 1
        else None
    )
    use_unsloth, reasons["unsloth"] = decide_kernels.unsloth(cfg, ctx, dev, distributed)
    if cfg.model.use_unsloth and not use_unsloth and distributed:
        notes.append(reasons["unsloth"])
    if use_unsloth and use_liger:  # both patch the same modules; Unsloth's kernels win
        use_liger = False
        reasons["liger"] = (
            "enable_liger_kernel: off, use_unsloth patches the same modules with its own kernels"
        )
        notes.append(reasons["liger"])
    if use_unsloth:
        reasons["attention"] = "Unsloth's own attention dispatch (flash_attn is taken over by Unsloth)"
    if cfg.model.enable_liger_kernel and not use_liger and not use_unsloth:
        notes.append(reasons["liger"])
    prec = decide.precision(cfg, ctx, dev, spec, zero, fsdp is not None)
    reasons["precision"] = prec.reason
    kernel, reasons["loss_kernel"] = decide_kernels.loss_kernel(spec, use_liger, zero, cfg, use_unsloth)
    lora, reasons["lora_kernel"] = decide_kernels.lora_kernel(cfg, zero, fsdp is not None)
    ckpt, reasons["checkpointing"] = decide.checkpointing(cfg, user.training.gradient_checkpointing)
    offload, reasons["checkpoint_offload"] = decide.checkpoint_offload(cfg, zero, fsdp is not None)
    fp8 = decide_kernels.fp8(cfg)
    if fp8.enabled and (small := decide_kernels.fp8_small_layers(cfg)):
        notes.append(small)
    compiled = decide_kernels.compile_plan(cfg, packed, use_liger, attn)
    if speed := decide_kernels.fp8_speed_note(cfg, fp8, compiled):
        notes.append(speed)
    reasons["fp8"], reasons["compile"] = fp8.reason, compiled.reason
    micro = t.per_device_train_batch_size
    capacity = decide.row_capacity(cfg, micro) if packed else None
    alloc = decide.allocator(cfg, ctx, dev, spec, packed, zero == 3 or fsdp is not None)
    reasons["allocator"] = alloc.reason
    rl, rl_why = decide_rl.rl_plan(cfg, spec, zero == 3 or fsdp is not None, attn)
    if rl is not None:
        reasons["rl"] = rl_why
    loader = decide_host.data_loader(user, ctx, dev, spec, world)  # `user`: which fields the YAML set
    reasons["data_workers"] = loader.reason
    optimizer, reasons["optimizer"] = decide_host.optimizer(user, dev, zero, fsdp is not None)
    kept_out, reasons["kept_out"] = decide_host.kept_out(cfg, ctx, spec, fp8.enabled, use_unsloth)
    return RunPlan(
        cfg=cfg,
        ctx=ctx,
        stage=spec,
        device=dev,
        precision=prec,
        packing=packed,
        row_capacity=capacity,
        split_long_texts=packed and spec.data == "text",
        attention=attn,
        liger=use_liger,
        unsloth=use_unsloth,
        loss_kernel=kernel,
        lora_kernel=lora,
        fp8=fp8,
        compile=compiled,
        deepspeed=ds,
        fsdp=fsdp,
        checkpointing=ckpt,
        checkpoint_offload=offload,
        micro_batch=micro if isinstance(micro, int) else 1,
        world_size=world,
        allocator=alloc,
        loader=loader,
        optimizer=optimizer,
        kept_out=kept_out,
        reasons=reasons,
        notes=tuple(notes),
        rl=rl,
        ray=ray,
    )


_AUTO = ("deepspeed", "per_device_train_batch_size", "gradient_checkpointing")
