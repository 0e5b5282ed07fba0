"""Experiment trackers (`report_to`, LLaMA-Factory's values) through transformers' own integration
callbacks, and what lmstack adds to each run:

- a tracker whose package is missing is refused before the model loads, naming the extra
  (`check`, run by train/preflight.py);
- TensorBoard writes to `logging_dir` when it is set (transformers 5 has no such argument);
- a wandb run is written under output_dir unless WANDB_DIR names another folder (wandb's default is
  the current folder); WANDB_MODE=offline keeps it on this machine;
- the resolved config, secrets masked, is logged as the run's parameters (`lmstack/<field>`), next to
  the Trainer's own arguments that the integrations log.

Each integration reads its library's standard environment (WANDB_MODE, WANDB_PROJECT, MLFLOW_TRACKING_URI,
SWANLAB_MODE, TRACKIO_DIR, ...); lmstack sets none of them."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmstack.config.errors import ConfigError
from lmstack.config.extras import require
from lmstack.config.schema import TRACKERS, Config
from lmstack.config.stages import stage_spec

logger = logging.getLogger(__name__)

PARAM_PREFIX = "lmstack/"
MLFLOW_BATCH = 100  # params per mlflow.log_params call (the tracking API's limit)
MLFLOW_VALUE_CHARS = 6000  # longest param value mlflow stores


def resolve(report_to: str) -> list[str]:
    """`none` -> [], `all` -> every tracker lmstack has that is installed here, else the names."""
    if report_to == "none":
        return []
    if report_to == "all":
        return [name for name in TRACKERS if importlib.util.find_spec(name) is not None]
    return report_to.split(",")


def active_names(cfg: Config) -> list[str]:
    """The trackers this run logs to: `report_to`, plus swanlab with LF's `use_swanlab`."""
    names = resolve(cfg.training.report_to)
    if cfg.training.use_swanlab and "swanlab" not in names:
        names.append("swanlab")
    return names


def trainer_report_to(cfg: Config) -> list[str]:
    """TrainingArguments.report_to: the integrations transformers builds. SwanLab runs through
    swanlab's own callback instead (`callbacks`), as LF does with use_swanlab: the one in transformers
    does not work with swanlab 0.10."""
    return [name for name in active_names(cfg) if name != "swanlab"]


def callbacks(cfg: Config) -> list:
    """swanlab's transformers callback when the run logs to SwanLab (report_to: swanlab or use_swanlab)."""
    if "swanlab" not in active_names(cfg):
        return []
    import os

    from swanlab.integration.transformers import SwanLabCallback

    t = cfg.training
    log_dir = t.swanlab_logdir or (
        None if os.environ.get("SWANLAB_LOG_DIR") else str(Path(t.output_dir) / "swanlog")
    )
    kwargs: dict[str, Any] = {"log_dir": log_dir}
    if t.use_swanlab:  # LF's fields; with report_to alone swanlab reads its SWANLAB_* environment
        kwargs.update(
            project=t.swanlab_project,
            workspace=t.swanlab_workspace,
            experiment_name=t.swanlab_run_name,
            mode=t.swanlab_mode,
        )
    return [SwanLabCallback(**kwargs)]


def check(cfg: Config) -> None:
    """Before the model loads: every named tracker is installed, and this stage reports to trackers."""
    names = active_names(cfg)
    if names and not stage_spec(cfg.finetuning.stage).trainer:
        raise ConfigError(
            f"report_to: {cfg.training.report_to} / use_swanlab: stage {cfg.finetuning.stage} runs lmstack's own "
            "loop, which logs to trainer_log.jsonl only; set report_to: none (and use_swanlab: false)"
        )
    problems = []
    for name in names:
        try:
            field = (
                "use_swanlab: true"
                if name == "swanlab" and cfg.training.use_swanlab
                else f"report_to: {name}"
            )
            require(name, field)
            if name == "mlflow":
                _check_mlflow_store()
        except ConfigError as err:
            problems.append(str(err))
    if problems:
        raise ConfigError("\n".join(problems))


def _check_mlflow_store() -> None:
    """mlflow opens its tracking store (MLFLOW_TRACKING_URI, default a sqlite file) when the run starts,
    after the model loaded; open it now. mlflow-skinny has no database store, and mlflow 3 refuses a
    file store unless MLFLOW_ALLOW_FILE_STORE=true."""
    import mlflow

    try:
        mlflow.MlflowClient()
    except Exception as err:  # mlflow raises its own exception types, and ImportErrors of its backends
        text = str(err).strip()
        first = text.splitlines()[0].split(". ")[0] if text else type(err).__name__
        raise ConfigError(
            f"report_to: mlflow: the tracking store {mlflow.get_tracking_uri()!r} cannot be opened "
            f"({first[:240]}); for a local file store set MLFLOW_TRACKING_URI=file:./mlruns and "
            "MLFLOW_ALLOW_FILE_STORE=true, or point MLFLOW_TRACKING_URI at a tracking server"
        ) from None


def run_params(cfg: Config) -> dict[str, Any]:
    """The resolved config as flat tracker parameters, `lmstack/<field>`, with secrets masked: SecretStr
    fields are `***`, and any registered secret or token pattern in a value is masked too."""
    from lmstack.config.secrets import redact

    def clean(value: Any) -> Any:
        if isinstance(value, str):
            return redact(value)
        if isinstance(value, list | tuple):
            return [clean(v) for v in value]
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        return value

    return {PARAM_PREFIX + key: clean(value) for key, value in cfg.flat(redact=True).items()}


@contextlib.contextmanager
def active(trainer: Any, cfg: Config) -> Iterator[None]:
    """Around train + final save: points the trainer's tracker callbacks at this run (logging_dir,
    wandb's folder), logs the run parameters once the runs exist, and finishes the wandb run lmstack
    started (an in-process caller, e.g. the web UI or a test, can train again)."""
    names = active_names(cfg)
    if not names or not trainer.is_world_process_zero():
        yield
        return
    from transformers.integrations import TensorBoardCallback

    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, TensorBoardCallback) and cfg.training.logging_dir:
            callback.logging_dir = str(Path(cfg.training.logging_dir).expanduser())
    started_wandb = "wandb" in names and _start_wandb(cfg)
    if "swanlab" in names and cfg.training.use_swanlab and cfg.training.swanlab_api_key is not None:
        import swanlab

        swanlab.login(api_key=cfg.training.swanlab_api_key.get_secret_value())  # LF logs in the same way
    trainer.add_callback(_params_callback(cfg, names, trainer))  # runs after the integrations' setup
    try:
        yield
    finally:
        if started_wandb:
            import wandb

            wandb.finish()


def _start_wandb(cfg: Config) -> bool:
    """Starts the wandb run transformers' WandbCallback would start (same project and name), in
    output_dir unless WANDB_DIR is set; False when a run is already active (the caller's own)."""
    import os

    import wandb

    if wandb.run is not None:
        return False
    t = cfg.training
    wandb.init(
        project=os.environ.get("WANDB_PROJECT", "huggingface"),  # transformers' default
        name=t.run_name,
        dir=None if os.environ.get("WANDB_DIR") else t.output_dir,
    )
    return True


def _param_text(params: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(params, sort_keys=False, allow_unicode=True, default_flow_style=False)


def _params_callback(cfg: Config, names: list[str], trainer: Any) -> Any:
    from transformers import TrainerCallback

    params = run_params(cfg)

    class TrackerParams(TrainerCallback):
        """Logs the run parameters to every tracker once, after the integrations started their runs."""

        done = False

        def on_train_begin(self, args, state, control, **kwargs):
            if self.done or not state.is_world_process_zero:
                return
            self.done = True
            for name in names:
                LOGGERS[name](params, trainer)

    return TrackerParams()


def _log_tensorboard(params: dict[str, Any], trainer: Any) -> None:
    from transformers.integrations import TensorBoardCallback

    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, TensorBoardCallback) and callback.tb_writer is not None:
            callback.tb_writer.add_text("lmstack_config", f"```\n{_param_text(params)}```")
            callback.tb_writer.flush()


def _log_wandb(params: dict[str, Any], trainer: Any) -> None:
    import wandb

    if wandb.run is not None:
        wandb.run.config.update(params, allow_val_change=True)


def _log_mlflow(params: dict[str, Any], trainer: Any) -> None:
    import mlflow

    if mlflow.active_run() is None:
        return
    items = [(k, str(v)[:MLFLOW_VALUE_CHARS]) for k, v in params.items()]
    for i in range(0, len(items), MLFLOW_BATCH):
        mlflow.log_params(dict(items[i : i + MLFLOW_BATCH]))


def _log_swanlab(params: dict[str, Any], trainer: Any) -> None:
    from swanlab.integration.transformers import SwanLabCallback

    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, SwanLabCallback):
            callback.update_config(params)


def _log_trackio(params: dict[str, Any], trainer: Any) -> None:
    import trackio

    trackio.config.update(params, allow_val_change=True)


LOGGERS = {
    "tensorboard": _log_tensorboard,
    "wandb": _log_wandb,
    "mlflow": _log_mlflow,
    "swanlab": _log_swanlab,
    "trackio": _log_trackio,
}
