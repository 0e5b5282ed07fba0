"""Steps every stage shares: device checks, output dir, TrainingArguments, callbacks, outputs."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

from lmstack.config.errors import ConfigError
from lmstack.config.load import save_config
from lmstack.config.schema import Config
from lmstack.plan.runplan import RunPlan
from lmstack.reliability.output_dir import CONFIG_FILE, LOG_FILE, OWN_OUTPUTS  # noqa: F401 (stages use them)
from lmstack.reliability.output_dir import prepare as prepare_output_dir
from lmstack.train import best_model, trackers

logger = logging.getLogger(__name__)


def start_run(plan: RunPlan) -> str | None:
    """Every stage's first step: the output dir; returns the checkpoint to resume from (or None).
    What may be found, deleted and resumed there: lmstack.reliability.output_dir."""
    return prepare_output_dir(plan)


def training_arguments(plan: RunPlan) -> Any:
    """The Trainer's arguments: the YAML's training fields plus the plan's precision, DeepSpeed/FSDP
    and device (never re-derived here)."""
    from transformers import TrainingArguments

    cfg = plan.cfg
    t = cfg.training
    kwargs: dict[str, Any] = dict(
        output_dir=t.output_dir,
        do_train=t.do_train,
        do_eval=t.do_eval,
        per_device_train_batch_size=t.per_device_train_batch_size,
        per_device_eval_batch_size=t.per_device_eval_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        learning_rate=t.learning_rate,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_epsilon=t.adam_epsilon,
        max_grad_norm=t.max_grad_norm,
        optim=plan.optimizer,  # the plan's implementation of `optim` (unset: fused AdamW)
        num_train_epochs=t.num_train_epochs,
        max_steps=t.max_steps,
        lr_scheduler_type=t.lr_scheduler_type,
        lr_scheduler_kwargs=dict(t.lr_scheduler_kwargs or {}),
        bf16=plan.precision.autocast == "bf16",
        fp16=plan.precision.autocast == "fp16",
        seed=t.seed,
        data_seed=t.seed,
        logging_steps=t.logging_steps,
        save_strategy=t.save_strategy,
        save_steps=t.save_steps,
        save_total_limit=t.save_total_limit,
        save_only_model=t.save_only_model,
        eval_strategy=t.eval_strategy,
        eval_steps=t.eval_steps,
        report_to=trackers.trainer_report_to(cfg),  # [] = none; `all` = the installed ones
        project=t.project,  # trackio's project
        load_best_model_at_end=t.load_best_model_at_end,
        metric_for_best_model=t.metric_for_best_model,
        greater_is_better=t.greater_is_better,
        dataloader_num_workers=plan.loader.workers,  # unset: the plan's worker processes
        dataloader_pin_memory=plan.loader.pin_memory,
        dataloader_persistent_workers=plan.loader.persistent,
        ddp_timeout=t.ddp_timeout,
        ddp_find_unused_parameters=t.ddp_find_unused_parameters,
        deepspeed=plan.deepspeed.config if plan.deepspeed else None,  # validated once by the plan
        torch_compile=False,  # torch_compile: the run plan compiles each decoder layer (plan.compile)
        disable_tqdm=t.disable_tqdm,
        use_cpu=plan.device == "cpu",
        remove_unused_columns=False,
        include_num_input_tokens_seen="non_padding",
        logging_nan_inf_filter=False,  # a NaN/Inf loss is logged as such (on_nonfinite decides what happens)
        train_sampling_strategy="sequential" if cfg.finetuning.disable_shuffling else "random",
        run_name=t.run_name,  # trackers' run name (LF passes it through)
    )
    if plan.fsdp is not None and plan.fsdp.source == "yaml":
        kwargs.update(fsdp=t.fsdp, fsdp_config=t.fsdp_config)
    _version_branches(kwargs, t, init_fields(TrainingArguments))
    return checked_init(TrainingArguments, kwargs)


def _version_branches(kwargs: dict[str, Any], t: Any, fields: set[str]) -> None:
    """The fields the supported transformers versions spell differently (deliberate, by version)."""
    if "warmup_ratio" in fields:  # transformers < 5.x had a separate ratio field
        kwargs.update(warmup_ratio=t.warmup_ratio, warmup_steps=t.warmup_steps)
    else:
        kwargs["warmup_steps"] = t.warmup_steps if t.warmup_steps > 0 else t.warmup_ratio
    if t.logging_dir and "logging_dir" in fields:
        kwargs["logging_dir"] = t.logging_dir
    if "train_sampling_strategy" not in fields:  # older transformers: always the random sampler
        kwargs.pop("train_sampling_strategy")


def init_fields(cls: type) -> set[str]:
    """The keyword arguments a dataclass (TrainingArguments, a TRL config) takes."""
    return {f.name for f in dataclasses.fields(cls) if f.init}


def checked_init(cls: type, kwargs: dict[str, Any]) -> Any:
    """`cls(**kwargs)`, refusing a key the installed class lacks: dropping it would silently run
    without a setting the YAML asked for (a renamed field after an upgrade, say)."""
    unknown = sorted(set(kwargs) - init_fields(cls))
    if unknown:
        from importlib.metadata import PackageNotFoundError, version

        package = cls.__module__.split(".")[0]
        try:
            installed = f"{package} {version(package)}"
        except PackageNotFoundError:
            installed = f"the installed {package}"
        raise ConfigError(
            f"{cls.__name__} of {installed} has no field {', '.join(unknown)}, which lmstack sets; "
            "install the transformers/TRL versions lmstack supports (pyproject.toml)"
        )
    return cls(**kwargs)


def checkpoint_kwargs(cfg: Config) -> dict:
    """torch.utils.checkpoint's keyword arguments: use_reentrant_gc, overridden by the keys of
    gradient_checkpointing_kwargs (as LLaMA-Factory hands that dict to transformers)."""
    return {"use_reentrant": cfg.model.use_reentrant_gc, **(cfg.training.gradient_checkpointing_kwargs or {})}


def enable_gradient_checkpointing(plan: RunPlan, model: Any) -> None:
    """Recompute activations in backward when the plan says so (auto already resolved there)."""
    if not plan.checkpointing:
        return
    if plan.unsloth:
        from lmstack.models.unsloth_model import is_unsloth

        if is_unsloth(model):
            logger.info("gradient checkpointing: Unsloth's own (activations offloaded to CPU), set at load")
            return
    cfg = plan.cfg
    # transformers >= 5.2x renamed it activation_checkpointing_enable; older 5.x only has the old name
    kwargs = checkpoint_kwargs(cfg)
    if plan.checkpoint_offload:  # use_unsloth_gc: lmstack's offloaded checkpointing (models/offload_ckpt.py)
        from lmstack.models.offload_ckpt import enable_offloaded_checkpointing

        enable_offloaded_checkpointing(model, kwargs)
    elif hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if plan.checkpoint_layers is not None:  # partial: the planner's count (plan/partial_ckpt.py)
        from lmstack.models.checkpointing import keep_activations_above

        keep_activations_above(model, plan.checkpoint_layers)
    if cfg.finetuning.finetuning_type != "full":
        model.enable_input_require_grads()  # frozen embeddings: reentrant checkpoints need a grad-requiring input
    where = ", layer inputs offloaded to CPU RAM" if plan.checkpoint_offload else ""
    if plan.checkpoint_layers is not None:
        where += f", only the first {plan.checkpoint_layers} decoder layers recompute"
    logger.info(
        "gradient checkpointing enabled (%s%s)", ", ".join(f"{k}={v}" for k, v in kwargs.items()), where
    )


def tokenizer_and_template(cfg: Config) -> tuple[Any, Any]:
    """The tokenizer, the template (by name, or from the tokenizer's own chat template), fixed up."""
    from lmstack.models.load import load_tokenizer
    from lmstack.templates import get_template

    tokenizer = load_tokenizer(cfg)
    template = get_template(
        cfg.data.template,
        tokenizer,
        thinking_style=cfg.data.thinking_style,
        escape_content=cfg.data.escape_special_tokens_in_content,
    )
    for note in template.fix_tokenizer(tokenizer):
        logger.info(note)
    return tokenizer, template


def build_trainer(
    plan: RunPlan, model: Any, tokenizer: Any, train: Any, evals: Any, collator: Any, args: Any
) -> Any:
    """transformers.Trainer made reliable (staged checkpoints + manifest, SIGTERM save, on_nonfinite),
    with lmstack's callbacks, the method optimizer (LoRA+, GaLore, APOLLO, BAdam, Muon, Adam-mini) and
    the custom token loss (DFT, EAFT, ASFT with its reference model) if any."""
    from lmstack.train import losses
    from lmstack.train.lm_trainer import ReliableSFTTrainer
    from lmstack.train.metrics import accuracy_trainer_kwargs
    from lmstack.train.optimizers import create_optimizer, method_callbacks

    cfg = plan.cfg
    asft = losses.active_loss(cfg) == "use_asft_loss"  # the reference logits of every batch
    return ReliableSFTTrainer(
        lm_master_weights=plan.precision.master_weights == "optimizer",  # bf16 model, fp32 masters
        lm_asft=asft,
        lm_reference=losses.asft_reference(plan, tokenizer) if asft else None,
        lmstack_cfg=cfg,
        lmstack_plan=plan.to_dict(),
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=evals,
        data_collator=collator,
        processing_class=tokenizer,
        callbacks=make_callbacks(cfg) + method_callbacks(cfg),
        optimizers=(create_optimizer(cfg, model, args), None),  # None: the Trainer builds it from `optim`
        compute_loss_func=losses.compute_loss_func(cfg),  # None: the model's own cross-entropy
        **accuracy_trainer_kwargs(cfg.finetuning.compute_accuracy),  # eval_accuracy (LF's compute_accuracy)
    )


def save_template_in_tokenizer(tokenizer: Any, template: Any) -> None:
    """The saved tokenizer chats in the training format (a built-in template becomes its Jinja twin),
    so inference from output_dir matches training (LF pitfall #7978)."""
    from lmstack.templates.export_formats import to_jinja
    from lmstack.templates.template import Template

    if isinstance(template, Template):
        tokenizer.chat_template = to_jinja(template)


class PadCollator:
    """Pads input_ids with the pad id, labels with -100; builds the attention mask."""

    def __init__(self, pad_id: int, multiple_of: int = 1):
        self.pad_id = pad_id
        self.multiple_of = multiple_of

    def __call__(self, features: list[dict]) -> dict:
        from lmstack.data.padding import pad_right

        longest = max(len(f["input_ids"]) for f in features)
        width = -(-longest // self.multiple_of) * self.multiple_of
        return pad_right(features, width, self.pad_id)


def make_callbacks(cfg: Config) -> list:
    from transformers import TrainerCallback

    class LogCallback(TrainerCallback):
        """Writes trainer_log.jsonl (one JSON per logging step, LF's keys); never duplicates on resume."""

        def __init__(self) -> None:
            self.start = time.time()
            self.start_step = 0

        def on_train_begin(self, args, state, control, **kwargs):
            self.start, self.start_step = time.time(), state.global_step
            path = Path(args.output_dir) / LOG_FILE
            if state.is_world_process_zero and path.is_file():
                kept = [
                    ln
                    for ln in path.read_text().splitlines()
                    if ln.strip() and json.loads(ln).get("current_steps", 0) <= state.global_step
                ]
                path.write_text("".join(ln + "\n" for ln in kept))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero or not logs:
                return
            elapsed = time.time() - self.start
            done = max(state.global_step - self.start_step, 1)
            remaining = elapsed / done * (state.max_steps - state.global_step)
            record = {
                "current_steps": state.global_step,
                "total_steps": state.max_steps,
                "loss": logs.get("loss"),
                "eval_loss": logs.get("eval_loss"),
                "reward": logs.get("rewards/chosen", logs.get("reward")),  # dpo/kto (LF's key); grpo
                "accuracy": logs.get("rewards/accuracies", logs.get("accuracy")),  # dpo; rm
                "lr": logs.get("learning_rate"),
                "epoch": round(state.epoch or 0.0, 4),
                "percentage": round(100 * state.global_step / max(state.max_steps, 1), 2),
                "elapsed_time": _hms(elapsed),
                "remaining_time": _hms(remaining),
                "total_tokens": state.num_input_tokens_seen or None,
                # grpo/rloo: each reward's mean (TRL's rewards/<name>/mean), one curve per reward
                **{k: v for k, v in logs.items() if k.startswith("rewards/") and k.endswith("/mean")},
                # grpo/rloo: the rollouts' speed (train/rollout_engine.py)
                **{k: v for k, v in logs.items() if k.startswith("rollout/")},
            }
            with (Path(args.output_dir) / LOG_FILE).open("a") as fh:
                fh.write(json.dumps({k: v for k, v in record.items() if v is not None}) + "\n")

    from lmstack.reliability.callbacks import CheckpointManifest

    # manifest: only for trainers without ReliableMixin; with the config, so it records the run
    return [
        LogCallback(),
        _save_last_step(),
        CheckpointManifest(cfg),
        *best_model.callbacks(cfg),
        *trackers.callbacks(cfg),
    ]


def _save_last_step() -> Any:
    from transformers import TrainerCallback

    class SaveLastStep(TrainerCallback):
        """The final step is always checkpointed (checkpoint-<max_steps> exists after every run)."""

        def on_step_end(self, args, state, control, **kwargs):
            if args.save_strategy != "no" and state.global_step >= state.max_steps:
                control.should_save = True

    return SaveLastStep()


def _hms(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def train_and_save(plan: RunPlan, trainer: Any, resume: str | None, plot_keys: tuple[str, ...] = ()) -> dict:
    """Every Trainer-based stage's last step: train (resuming when asked), write the outputs (plots of
    the loss and of the stage's own `plot_keys` with `plot_loss`); returns the train metrics."""
    cfg = plan.cfg
    with trackers.active(trainer, cfg):  # logging_dir, wandb's folder, the run's parameters
        result = trainer.train(resume_from_checkpoint=resume)
        save_outputs(plan, trainer, result, plot_keys)
    logger.info("outputs written to %s", cfg.training.output_dir)
    return dict(result.metrics)


def save_outputs(plan: RunPlan, trainer: Any, train_result: Any, plot_keys: tuple[str, ...] = ()) -> None:
    """Final model/adapter + tokenizer, trainer_state.json, *_results.json, plots; the resolved config
    and the run plan in lmstack_config.yaml / run_manifest.json."""
    cfg = plan.cfg
    from lmstack.models.adapter_save import save_model
    from lmstack.reliability import final_outputs
    from lmstack.reliability.outputs_record import output_files, record_outputs

    out = Path(cfg.training.output_dir)
    before = output_files(cfg.training.output_dir)  # what the save writes is recorded against this
    if trainer.is_world_process_zero():
        final_outputs.begin(out)  # until complete(): readers see the outputs as unfinished
    save_model(trainer)  # a LoRA adapter is checked on disk: an empty one is an error
    trainer.save_state()
    metrics = dict(train_result.metrics)
    if (
        cfg.finetuning.include_effective_tokens_per_second
    ):  # LF's metric: trained-on tokens per second per device
        seen, runtime = trainer.state.num_input_tokens_seen, metrics.get("train_runtime") or 0
        metrics["effective_tokens_per_sec"] = round(seen / runtime / plan.world_size, 2) if runtime else 0.0
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    if cfg.training.do_eval and trainer.eval_dataset is not None:
        eval_metrics = trainer.evaluate()
        trainer.log_metrics("eval", eval_metrics)
        trainer.save_metrics("eval", eval_metrics)
    if trainer.is_world_process_zero():
        save_config(cfg, Path(cfg.training.output_dir) / CONFIG_FILE, plan_lines=plan.describe())
        from lmstack.reliability.manifest import RUN_MANIFEST, write_run_manifest

        if not (Path(cfg.training.output_dir) / RUN_MANIFEST).is_file():  # ReliableMixin trainers wrote it
            write_run_manifest(cfg, plan=plan.to_dict())
        if cfg.finetuning.plot_loss:
            from lmstack.train.plots import plot_metrics

            for path in plot_metrics(
                cfg.training.output_dir, ["loss", "eval_loss", "eval_accuracy", *plot_keys]
            ):
                logger.info("wrote %s", path)
        record_outputs(cfg.training.output_dir, before)  # an overwriting run removes exactly these
        final_outputs.complete(out)  # last: every final file is whole
