"""`check(plan)`: everything that can be checked without loading the model, reported all at once.

Each check names the field, the value and the fix; they all run (a later one never hides behind an
earlier one) and the problems are raised together as one ConfigError (exit 2)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from lmstack.config.errors import ConfigError, LmstackError
from lmstack.plan.rules import check_rules
from lmstack.plan.runplan import RunPlan

logger = logging.getLogger(__name__)


def _model(plan: RunPlan) -> None:
    from lmstack.models.load import check_model_path

    check_model_path(plan.cfg)


def _template(plan: RunPlan) -> None:
    from lmstack.templates import get_template

    data = plan.cfg.data
    if data.template or data.escape_special_tokens_in_content:
        get_template(data.template, escape_content=data.escape_special_tokens_in_content)


def _template_tokens(plan: RunPlan) -> None:
    """A template that would add its turn tokens to the tokenizer is another family's (llama3 on a Qwen
    tokenizer): refused, naming the template the tokenizer's own chat template matches. resize_vocab:
    true says the new tokens are meant (their embeddings are trained from random)."""
    from lmstack.models.load import check_model_path, load_tokenizer
    from lmstack.plan.model_config import config_json
    from lmstack.templates import get_template
    from lmstack.templates.match import mismatch

    cfg = plan.cfg
    if not cfg.data.template or cfg.model.resize_vocab:
        return
    try:
        check_model_path(cfg)  # a missing model or tokenizer is the model check's to report
        template = get_template(cfg.data.template)  # an unknown name is the template check's
    except LmstackError:
        return
    family = str((config_json(cfg) or {}).get("model_type", ""))
    problem = mismatch(load_tokenizer(cfg), template, cfg.model.model_name_or_path, family)
    if problem:
        raise ConfigError(problem)


def _datasets(plan: RunPlan) -> None:
    from lmstack.data.pipeline import check_data_args
    from lmstack.data.registry import get_dataset_attrs

    cfg = plan.cfg
    if cfg.training.do_train and not cfg.data.dataset:
        raise ConfigError("dataset: required for training; name datasets registered in dataset_info.json")
    get_dataset_attrs(cfg.data.dataset, cfg.data.dataset_dir, "dataset")
    get_dataset_attrs(cfg.data.eval_dataset, cfg.data.dataset_dir, "eval_dataset")
    check_data_args(cfg)


def _adapters(plan: RunPlan) -> None:
    cfg = plan.cfg
    if cfg.finetuning.finetuning_type != "lora" and cfg.model.adapter_name_or_path:
        raise ConfigError("adapter_name_or_path: adapters need finetuning_type: lora")
    from lmstack.models.adapter_save import check_adapter_files

    check_adapter_files(cfg.model.adapter_name_or_path)


def _methods(plan: RunPlan) -> None:
    from lmstack.train.method_rules import check_methods

    check_methods(plan.cfg, plan.world_size, plan.zero_stage)  # LoRA variants, GaLore/APOLLO/BAdam/Muon


def _quantization(plan: RunPlan) -> None:
    from lmstack.models.quantization import check_quantization

    check_quantization(plan.cfg, plan.sharded, plan.device, plan.ctx.has("bitsandbytes"))


def _stage(plan: RunPlan) -> None:
    from lmstack.train.rlhf import check_stage_config

    check_stage_config(plan.cfg)  # sft-only fields elsewhere, rewards, reference models, kto/grpo batches


def _accuracy(plan: RunPlan) -> None:
    from lmstack.train.metrics import warn_compute_accuracy

    cfg = plan.cfg
    if (
        plan.is_main and plan.stage.eval_accuracy
    ):  # a warning when nothing is evaluated (rules refuse a stage)
        warn_compute_accuracy(
            cfg.finetuning.compute_accuracy,
            has_eval_data=bool(cfg.data.val_size or cfg.data.eval_dataset),
            evaluates=cfg.training.do_eval or cfg.training.eval_strategy != "no",
        )


def _evaluation(plan: RunPlan) -> None:
    data, strategy = plan.cfg.data, plan.cfg.training.eval_strategy
    if strategy != "no" and not (data.val_size or data.eval_dataset):  # transformers raises after the load
        raise ConfigError(
            f"eval_strategy: {strategy} needs evaluation data; set val_size (e.g. 0.1) or eval_dataset, "
            "or set eval_strategy: no"
        )


def _deepspeed_device(plan: RunPlan) -> None:
    # DeepSpeed's engine needs a CUDA GPU; on a CPU-only machine it fails inside from_pretrained (and
    # `pip install deepspeed` there only moves the crash into mpi4py), so the advice is to drop it here
    if plan.deepspeed is not None and plan.device != "cuda":
        raise ConfigError(
            f"deepspeed: {plan.deepspeed.ref} needs a CUDA GPU and this machine has none (device "
            f"{plan.device}); remove the deepspeed line to train on {plan.device} without "
            "ZeRO, or run the YAML as it is on a machine with an NVIDIA GPU (installing deepspeed here does "
            "not help: DeepSpeed trains on GPUs only)"
        )


def _trackers(plan: RunPlan) -> None:
    from lmstack.train.trackers import check as check_trackers

    check_trackers(plan.cfg)  # report_to: installed (naming the extra), and a stage that reports


def _best_model(plan: RunPlan) -> None:
    from lmstack.train.best_model import check as check_best_model

    check_best_model(plan.cfg)  # load_best_model_at_end / early_stopping_steps combinations


def _output_dir(plan: RunPlan) -> None:
    from lmstack.reliability.path_guards import check_output_dir

    check_output_dir(plan.cfg)  # never the model, an adapter or the data (nor inside / around one); writable


CHECKS: list[Callable[[RunPlan], None]] = [
    _output_dir,
    _model,
    _template,
    _template_tokens,
    _datasets,
    _adapters,
    _methods,
    _quantization,
    _stage,
    _accuracy,
    _evaluation,
    _trackers,
    _best_model,
]


def check(plan: RunPlan, launch: bool = True) -> list[str]:
    """Runs the conflict rules and every check; returns the notes of documented fallbacks (to log once)
    and raises one ConfigError listing every problem found. `launch=False` (lmstack check) leaves out
    the rules about this machine's launch (process count, installed DeepSpeed)."""
    notes, problems = check_rules(plan, launch)
    errors: list[LmstackError] = [ConfigError(p) for p in problems]
    for step in [*CHECKS, _deepspeed_device] if launch else CHECKS:
        try:
            step(plan)
        except LmstackError as err:
            errors.append(err)
    if len(errors) == 1:
        raise errors[0]  # one problem keeps its own type (ConfigError / DataError)
    if errors:
        raise ConfigError(f"{len(errors)} problems in the config:\n" + "\n".join(str(e) for e in errors))
    return notes
