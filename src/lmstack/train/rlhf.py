"""Pieces the preference and RL stages share (dpo, kto, rm, ppo, grpo): TRL configs built from our
TrainingArguments, our token rows as `datasets.Dataset`, the reference model."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from lmstack.config.errors import ConfigError
from lmstack.config.schema import Config
from lmstack.config.stages import stage_spec
from lmstack.data.encode_pref import split_row
from lmstack.plan.runplan import RunPlan
from lmstack.train import common

logger = logging.getLogger(__name__)


def trl_config(plan: RunPlan, config_cls: type, **extra: Any) -> Any:
    """A TRL config (a TrainingArguments subclass) with every field our YAML sets, plus `extra`.
    TRL's own defaults (e.g. gradient_checkpointing=True, bf16=True) never leak in. A key the installed
    config lacks is refused (common.checked_init), never dropped."""
    base = common.training_arguments(plan)
    kwargs = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    kwargs.update(extra)
    return common.checked_init(config_cls, kwargs)


def to_dataset(rows: Iterable[dict], adapt: Callable[[dict], dict]) -> Any:
    """Our token rows -> a `datasets.Dataset` with the columns a TRL trainer reads."""
    from datasets import Dataset

    return Dataset.from_list([adapt(r) for r in rows])


def pairwise_columns(row: dict) -> dict:
    """Pairwise rows -> TRL 1.16's pre-tokenized preference columns."""
    prompt, chosen = split_row(row["chosen_input_ids"], row["chosen_labels"])
    prompt_r, rejected = split_row(row["rejected_input_ids"], row["rejected_labels"])
    assert prompt == prompt_r, "chosen and rejected rows must share the prompt"
    return {"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected}


def _frozen(model: Any) -> Any:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def load_frozen_model(plan: RunPlan, path: str, adapters: str | None, tokenizer: Any) -> Any:
    """A frozen causal LM from `path` with `adapters` (comma-separated) merged in. It only computes, so it
    loads in the compute dtype, like LF's loads of a model it does not train: the fp32 that classic AMP
    gives the trained model holds master weights, which a frozen copy has none of (it would double the
    copy's memory: 2 B/param more; a full DPO 1.5B peaked at 34.57 GiB on the H200 with the copy in fp32,
    31.69 with it in bf16). The two then agree to bf16 rounding at the first step, not bit for bit (DPO's
    first rewards/margins a few hundredths from 0, as in LF)."""
    from dataclasses import replace

    from lmstack.models.load import load_model

    model = load_model(replace(plan.model_spec(path), load_dtype=plan.precision.compute), tokenizer)
    if adapters:
        from peft import PeftModel

        for adapter in [a.strip() for a in adapters.split(",") if a.strip()]:
            model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return _frozen(model)


def reference_model(plan: RunPlan, tokenizer: Any, needs_reference: bool = True) -> Any | None:
    """LLaMA-Factory's rule: `ref_model` if set; else LoRA -> None (the trainer disables the adapter: no
    second copy in memory); full/freeze -> a frozen copy of the starting model."""
    cfg = plan.cfg
    ft = cfg.finetuning
    if not needs_reference:
        return None
    if ft.ref_model:
        logger.info("reference model: %s", ft.ref_model)
        return load_frozen_model(plan, ft.ref_model, ft.ref_model_adapters, tokenizer)
    if ft.finetuning_type == "lora":
        logger.info("reference model: the base model with the LoRA adapter disabled (no copy)")
        return None
    logger.info("reference model: a frozen copy of %s", cfg.model.model_name_or_path)
    return load_frozen_model(plan, cfg.model.model_name_or_path, cfg.model.adapter_name_or_path, tokenizer)


def drop_trl_ref_adapter(cfg: Config, model: Any) -> None:
    """TRL 1.16 adds a 'ref' copy of a PEFT model's adapter when no ref_model is given. For a fresh
    adapter (zero-initialised LoRA B) the base with the adapter disabled is that same reference, so
    the copy is removed; a resumed adapter (adapter_name_or_path) keeps it as its reference."""
    peft_config = getattr(model, "peft_config", None)
    if peft_config and "ref" in peft_config and not cfg.model.adapter_name_or_path:
        model.delete_adapter("ref")
        model.set_adapter("default")


def check_reward_model_dir(path: str, field: str = "reward_model") -> Path:
    out = Path(path)
    if not (out / "value_head.safetensors").is_file():
        raise ConfigError(
            f"{field}: {path} has no value_head.safetensors; give the output_dir of an lmstack "
            "`stage: rm` run"
        )
    return out


def plot(cfg: Config, keys: list[str]) -> None:
    if cfg.finetuning.plot_loss:
        from lmstack.train.plots import plot_metrics

        for path in plot_metrics(cfg.training.output_dir, keys):
            logger.info("wrote %s", path)


def split_specs(value: str | None) -> list[str]:
    return [s.strip() for s in (value or "").split(",") if s.strip()]


def import_reward_func(spec: str, field: str = "reward_funcs") -> Callable:
    """'pkg.module:function' or 'path/to/file.py:function' -> the function (errors name the field)."""
    module_name, _, func_name = spec.rpartition(":")
    if not module_name or not func_name:
        raise ConfigError(f"{field}: {spec!r} is not 'pkg.module:function' or 'file.py:function'")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ConfigError(f"{field}: file {module_name} not found (in {spec!r})")
            loaded = importlib.util.spec_from_file_location(f"lmstack_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(loaded)
            loaded.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"{field}: cannot import {module_name} ({err}); check {spec!r}") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ConfigError(f"{field}: {module_name} has no function {func_name!r} (in {spec!r})")
    return func


def reward_functions(cfg: Config) -> list[Callable]:
    """reward_funcs in order: a shipped name (accuracy | format | length, train/rewards.py) or a
    'pkg.module:function' / 'file.py:function' spec."""
    from lmstack.plan.decide_rl import SHIPPED_REWARDS
    from lmstack.train.rewards import shipped_reward

    out = []
    for spec in split_specs(cfg.finetuning.reward_funcs):
        if spec in SHIPPED_REWARDS:
            out.append(shipped_reward(spec, cfg))
        elif ":" not in spec:
            raise ConfigError(
                f"reward_funcs: {spec!r} is neither a shipped reward ({' | '.join(SHIPPED_REWARDS)}) nor "
                "'pkg.module:function' / 'file.py:function'"
            )
        else:
            out.append(import_reward_func(spec))
    return out


# ---- pre-flight: stage/field conflicts, checked before anything loads ----------------------------
def check_stage_config(cfg: Config) -> None:
    """Each error names the field, the value and the fix (called by train.run.preflight)."""
    ft, stage = cfg.finetuning, cfg.finetuning.stage
    for name in ("neat_packing", "train_on_prompt", "mask_history"):
        if (
            getattr(cfg.data, name, False)
            and stage != "sft"
            and not (name == "neat_packing" and stage == "pt")
        ):
            raise ConfigError(
                f"{name}: true is an sft setting and has no meaning for stage {stage}; remove it"
            )
    spec = stage_spec(stage)
    if spec.needs_reward and not ft.reward_model and not ft.reward_funcs:
        raise ConfigError(
            f"reward_model: stage {stage} needs a reward: set reward_model to the output_dir of a "
            "`stage: rm` run, or reward_funcs to 'pkg.module:function'"
        )
    if ft.reward_model and spec.needs_reward:
        _check_reward_model(cfg)
    if ft.reward_model_adapters:
        raise ConfigError(
            "reward_model_adapters: not used by lmstack (an rm output_dir holds its own adapter); "
            "give that directory as reward_model and remove reward_model_adapters"
        )
    if ft.reward_funcs:
        if spec.needs_reward:
            reward_functions(cfg)  # import now: a typo fails before the model loads
            if stage == "ppo" and "accuracy" in split_specs(ft.reward_funcs):
                raise ConfigError(
                    "reward_funcs: accuracy compares with the dataset's reference answers, which stage ppo does "
                    "not hand to its rewards; use stage: grpo or rloo, or a reward of your own"
                )
        else:
            logger.warning("reward_funcs: has no effect for stage %s (ppo and grpo use it)", stage)
    if ft.tool_funcs and stage == "grpo":
        for spec in split_specs(ft.tool_funcs):
            import_reward_func(spec, "tool_funcs")  # import now: a typo fails before the model loads
    _check_reference(cfg)
    if ft.dpo_label_smoothing > 0 and (stage != "dpo" or ft.pref_loss != "sigmoid"):
        raise ConfigError(
            f"dpo_label_smoothing: {ft.dpo_label_smoothing} applies to stage dpo with pref_loss: sigmoid "
            f"only (got stage {stage}, pref_loss {ft.pref_loss}); set it to 0"
        )
    t = cfg.training
    if (
        stage in ("grpo", "rloo")
        and (t.per_device_train_batch_size * t.gradient_accumulation_steps) % ft.num_generations
    ):
        raise ConfigError(
            f"num_generations: {ft.num_generations} must divide per_device_train_batch_size x "
            f"gradient_accumulation_steps = {t.per_device_train_batch_size * t.gradient_accumulation_steps} "
            "(each batch holds whole groups of answers to one prompt)"
        )
    if stage == "kto":
        _check_kto_datasets(cfg)


def _check_reward_model(cfg: Config) -> None:
    ft = cfg.finetuning
    if ft.reward_model_type == "api":
        raise ConfigError(
            "reward_model_type: api is not supported; use lora or full with the output_dir of a `stage: rm` run"
        )
    out = Path(ft.reward_model)
    if not out.is_dir():
        raise ConfigError(
            f"reward_model: directory not found: {ft.reward_model}; give the output_dir of a `stage: rm` run"
        )
    check_reward_model_dir(ft.reward_model)
    has_adapter = (out / "adapter_config.json").is_file()
    if ft.reward_model_type == "lora" and not has_adapter:
        raise ConfigError(
            f"reward_model_type: lora, but {out} holds full weights (no adapter_config.json); "
            "set reward_model_type: full"
        )
    if ft.reward_model_type == "full" and has_adapter:
        raise ConfigError(
            f"reward_model_type: full, but {out} holds a LoRA adapter; set reward_model_type: lora"
        )


def _check_reference(cfg: Config) -> None:
    ft, stage = cfg.finetuning, cfg.finetuning.stage
    if ft.ref_model_adapters and not ft.ref_model:
        raise ConfigError(
            "ref_model_adapters: needs ref_model (the model the adapters belong to); set ref_model"
        )
    if not ft.ref_model:
        return
    if not stage_spec(stage).reference:
        logger.warning("ref_model: has no effect for stage %s (dpo, kto and ppo use a reference)", stage)
    elif stage == "dpo" and ft.pref_loss in ("orpo", "simpo"):
        logger.warning(
            "ref_model: has no effect with pref_loss: %s (it uses no reference model)", ft.pref_loss
        )
    elif not Path(ft.ref_model).expanduser().exists() and len(ft.ref_model.split("/")) != 2:
        raise ConfigError(f"ref_model: directory not found: {ft.ref_model}; give a model directory or hub id")


def _check_kto_datasets(cfg: Config) -> None:
    from lmstack.data.registry import get_dataset_attrs

    for field_name, names in (("dataset", cfg.data.dataset), ("eval_dataset", cfg.data.eval_dataset)):
        for attr in get_dataset_attrs(names, cfg.data.dataset_dir, field_name):
            if not attr.columns.get("kto_tag"):
                raise ConfigError(
                    f"{field_name}: {attr.name} has no kto_tag column; stage kto needs each answer tagged "
                    'true/false: add "kto_tag": "<column>" to its columns in dataset_info.json'
                )
