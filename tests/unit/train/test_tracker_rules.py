"""report_to resolution and the pre-load tracker checks (train/trackers.py)."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config
from lmstack.config.schema import TRACKERS
from lmstack.launch.context import LaunchContext
from lmstack.plan.runplan import RunPlan
from lmstack.train import trackers
from lmstack.train.common import training_arguments

BASE = {"model_name_or_path": "m", "output_dir": "o", "dataset": "d"}


def test_all_means_every_installed_tracker(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not importable here
    names = trackers.resolve("all")
    assert "wandb" not in names
    assert names == [t for t in TRACKERS if t != "wandb" and importlib.util.find_spec(t) is not None]
    assert trackers.resolve("none") == [] and trackers.resolve("wandb,mlflow") == ["wandb", "mlflow"]


def test_swanlab_runs_through_its_own_callback_not_transformers(tiny_model):
    cfg = build_config({**BASE, "model_name_or_path": str(tiny_model), "report_to": "tensorboard,swanlab"})
    assert trackers.trainer_report_to(cfg) == ["tensorboard"]
    assert training_arguments(RunPlan.resolve(cfg, LaunchContext.from_env())).report_to == ["tensorboard"]
    cfg = build_config({**BASE, "use_swanlab": True})
    assert trackers.active_names(cfg) == ["swanlab"] and trackers.trainer_report_to(cfg) == []


def test_trackio_project_reaches_the_trainer(tiny_model):
    cfg = build_config(
        {**BASE, "model_name_or_path": str(tiny_model), "report_to": "trackio", "project": "p1"}
    )
    args = training_arguments(RunPlan.resolve(cfg, LaunchContext.from_env()))
    assert args.project == "p1" and args.report_to == ["trackio"]
    with pytest.raises(ConfigError, match="project: "):
        build_config({**BASE, "project": ""})  # LF: trackio needs a project name


def test_ppo_refuses_trackers_it_would_ignore():
    with pytest.raises(
        ConfigError, match=r"report_to: tensorboard / use_swanlab: stage ppo runs lmstack's own loop"
    ):
        trackers.check(
            build_config({**BASE, "stage": "ppo", "report_to": "tensorboard", "reward_model": "r"})
        )


def test_every_missing_tracker_is_named_at_once(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setitem(sys.modules, "trackio", None)
    with pytest.raises(ConfigError) as err:
        trackers.check(build_config({**BASE, "report_to": ["wandb", "trackio"]}))
    assert str(err.value).splitlines() == [
        "report_to: wandb needs `wandb`, which is not installed; pip install 'lmstack[wandb]'",
        "report_to: trackio needs `trackio`, which is not installed; pip install 'lmstack[trackio]'",
    ]


def test_run_params_mask_secrets_in_every_field():
    from lmstack.config import secrets

    secrets.register("plain-secret-value-123")
    cfg = build_config(
        {**BASE, "hf_hub_token": "hf_abcdefghijkl0123", "run_name": "x-plain-secret-value-123"}
    )
    params = trackers.run_params(cfg)
    assert params["lmstack/hf_hub_token"] == "***" and params["lmstack/run_name"] == "x-***"
    assert params["lmstack/model_name_or_path"] == "m"
