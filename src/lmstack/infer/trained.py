"""What `lmstack chat`, `lmstack api` and `lmstack export` load from a training YAML.

With `adapter_name_or_path` unset, the outputs training wrote to `output_dir` are used:

- `finetuning_type: lora` and `output_dir/adapter_config.json`: that adapter, on `model_name_or_path`
  (refused when the adapter names another base model);
- `finetuning_type: full | freeze` and full weights in `output_dir` (`config.json` + `model*.safetensors`):
  the model is loaded from `output_dir`;
- `output_dir` unset (an inference YAML) or holding neither: the base model.

One log line says which. Outputs of the other finetuning type are refused (the YAML and the folder
disagree). An explicit `adapter_name_or_path` is used as given; `output_dir=` (empty) on the command
line chats with the base model of a training YAML.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path, PurePath

from lmstack.config.errors import ConfigError
from lmstack.config.schema import Config

logger = logging.getLogger(__name__)

# `output_dir` is required by the schema (for `lmstack train`); an inference YAML may leave it out.
NO_OUTPUT_DIR = "unused-by-inference"


def has_adapter(path: Path) -> bool:
    return (path / "adapter_config.json").is_file()


def has_full_weights(path: Path) -> bool:
    weights = any(path.glob("model*.safetensors")) or (path / "model.safetensors.index.json").is_file()
    return (path / "config.json").is_file() and weights


def resolve_trained_model(cfg: Config) -> Config:
    """`cfg` with the adapter or the model that training wrote to `output_dir` (see the module doc);
    checked and logged before anything loads. The returned config is a copy; `cfg` is unchanged."""
    model, out = cfg.model, cfg.training.output_dir
    if model.adapter_name_or_path:
        return cfg
    if out == NO_OUTPUT_DIR:
        logger.info(
            "adapter_name_or_path and output_dir are unset: using the base model %s", model.model_name_or_path
        )
        return cfg
    path, kind = Path(out).expanduser(), cfg.finetuning.finetuning_type
    _refuse_two_runs(path, kind)
    if has_adapter(path) and kind == "lora":
        check_adapter_base(path, model.model_name_or_path)
        logger.info("adapter_name_or_path is unset: using the LoRA adapter trained in output_dir %s", out)
        return cfg.model_copy(update={"model": model.model_copy(update={"adapter_name_or_path": out})})
    if has_full_weights(path) and kind != "lora" and not has_adapter(path):
        logger.info(
            "adapter_name_or_path is unset: loading the %s-finetuned model trained in output_dir %s "
            "(not model_name_or_path %s)",
            kind,
            out,
            model.model_name_or_path,
        )
        return cfg.model_copy(update={"model": model.model_copy(update={"model_name_or_path": out})})
    _refuse_other_kind(path, kind)
    logger.warning(
        "output_dir %s holds no trained outputs (%s): using the base model %s",
        out,
        _what_is_missing(path, kind),
        model.model_name_or_path,
    )
    return cfg


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
FULL_FILES = ("config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json")


def last_run_kind(path: Path) -> str | None:
    """finetuning_type of the last run that finished in `path` (its lmstack_config.yaml), None unknown."""
    import yaml

    try:
        saved = yaml.safe_load((path / "lmstack_config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    kind = saved.get("finetuning_type", "lora") if isinstance(saved, dict) else None
    return kind if isinstance(kind, str) else None


def _refuse_two_runs(path: Path, kind: str) -> None:
    """An adapter and full weights side by side: outputs of two runs (a LoRA run, then a full one into
    the same folder without the overwrite cleanup). Loading either could load the stale one, and the
    folder does not load as a model while adapter_config.json is in it (transformers then loads the
    adapter), so the hint names the stale files to delete, from the last run's lmstack_config.yaml."""
    if not (has_adapter(path) and has_full_weights(path)):
        return
    last = last_run_kind(path)
    if last == "lora" == kind:
        return  # the adapter is the last run's: it is what the YAML asks for
    if last is None:
        stale = (
            f"delete the files of the run you do not want: {', '.join(ADAPTER_FILES)} (the adapter) or "
            f"{', '.join(FULL_FILES)} (the full weights)"
        )
    else:
        old = FULL_FILES if last == "lora" else ADAPTER_FILES
        stale = (
            f"its lmstack_config.yaml says the last run was finetuning_type: {last}, so "
            f"{'the full weights are' if last == 'lora' else 'the adapter is'} left from an earlier run: "
            f"delete {', '.join(old)} from {path}"
            + (f" and set finetuning_type: {last}" if (last == "lora") != (kind == "lora") else "")
        )
    raise ConfigError(
        f"output_dir: {path} holds both a LoRA adapter (adapter_config.json) and full model weights "
        f"(config.json + model*.safetensors), the outputs of two runs; {stale}. A run with "
        "overwrite_output_dir: true removes the outputs an earlier lmstack run wrote, so this cannot recur"
    )


def _refuse_other_kind(path: Path, kind: str) -> None:
    """Outputs of the other finetuning type: the YAML and output_dir disagree."""
    if has_adapter(path):
        raise ConfigError(
            f"output_dir: {path} holds a LoRA adapter (adapter_config.json) but finetuning_type is {kind!r}; "
            "set finetuning_type: lora to use it, or adapter_name_or_path / model_name_or_path to load "
            "something else"
        )
    if has_full_weights(path):
        raise ConfigError(
            f"output_dir: {path} holds full model weights (config.json + model.safetensors) but "
            f"finetuning_type is {kind!r}; set finetuning_type: full (or freeze) to load them"
        )


def _what_is_missing(path: Path, kind: str) -> str:
    if not path.is_dir():
        return "the folder does not exist"
    wanted = "adapter_config.json" if kind == "lora" else "config.json + model*.safetensors"
    checkpoints = sorted(p.name for p in path.glob("checkpoint-*") if p.is_dir())
    if not checkpoints:
        return f"no {wanted}"
    field = "adapter_name_or_path" if kind == "lora" else "model_name_or_path"
    return f"no {wanted}, only {', '.join(checkpoints)}: set {field}: {path / checkpoints[-1]} to use one"


def check_adapter_base(adapter: Path, model_name_or_path: str) -> None:
    """Refuses an adapter whose adapter_config.json clearly names another base model."""
    try:
        trained_on = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError) as err:
        raise ConfigError(f"output_dir: {adapter}/adapter_config.json cannot be read: {err}") from None
    if not trained_on or same_model(trained_on, model_name_or_path):
        return
    raise ConfigError(
        f"output_dir: the LoRA adapter in {adapter} was trained on {trained_on!r} (base_model_name_or_path "
        f"in its adapter_config.json) but model_name_or_path is {model_name_or_path!r}; set "
        f"model_name_or_path: {trained_on}, or set adapter_name_or_path: {adapter} to apply it to "
        f"{model_name_or_path!r} anyway"
    )


def model_name(name_or_path: str) -> str:
    """The model's own name in a hub id or path: `Qwen/Qwen2.5-0.5B`, `/models/Qwen2.5-0.5B` and
    `.../models--Qwen--Qwen2.5-0.5B/snapshots/<hash>` all give `qwen2.5-0.5b`."""
    parts = PurePath(name_or_path.rstrip("/\\")).parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].split("--")[-1].lower()
    return parts[-1].lower() if parts else ""


def same_model(a: str, b: str) -> bool:
    """False only when the two clearly name different models: different names, not one folder."""
    if model_name(a) == model_name(b):
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()
