"""dpo / kto / rm build their TRL config (which refuses a key the installed TRL lacks) before the model
loads: a mismatched TRL fails in seconds, naming the key, not after the weights (and a reference model)
are read. The weights file here is garbage, so loading it first would fail with a different error."""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config
from lmstack.launch.context import LaunchContext
from lmstack.plan.runplan import RunPlan


@dataclasses.dataclass
class _OlderTRLConfig:
    """A TRL config that lacks every field lmstack sets but output_dir (an incompatible TRL)."""

    output_dir: str = "o"


@pytest.mark.parametrize(
    ("stage", "dataset", "module", "config_name"),
    [
        ("dpo", "dpo_en_demo", "dpo", "DPOConfig"),
        ("kto", "kto_en_demo", "kto", "KTOConfig"),
        ("rm", "dpo_en_demo", "rm", "RewardConfig"),
    ],
)
def test_a_bad_trl_key_fails_before_the_weights_load(
    base_cfg, tiny_model, tmp_path, monkeypatch, stage, dataset, module, config_name
):
    import importlib

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model, model_dir)
    for weights in model_dir.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    stage_module = importlib.import_module(f"lmstack.train.{module}")
    monkeypatch.setattr(stage_module, config_name, _OlderTRLConfig)
    cfg = build_config({**base_cfg, "model_name_or_path": str(model_dir), "stage": stage, "dataset": dataset})
    plan = RunPlan.resolve(cfg, LaunchContext.from_env())
    with pytest.raises(
        ConfigError, match=r"_OlderTRLConfig of .* has no field .*\bper_device_train_batch_size\b"
    ):
        stage_module.run(plan)
