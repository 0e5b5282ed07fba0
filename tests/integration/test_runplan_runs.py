"""Real runs on the tiny model for decisions the run plan now owns (each failed before it)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml
from safetensors import safe_open

from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config
from lmstack.launch.context import LaunchContext
from lmstack.plan.runplan import RunPlan
from lmstack.train.run import train


def pt_cfg(base_cfg, **over):
    return {**base_cfg, "stage": "pt", "dataset": "c4_demo", "cutoff_len": 64, "max_steps": 2, **over}


def test_pt_with_streaming_and_packing_unset_trains(base_cfg):
    # before: TypeError: object of type 'StreamingDataset' has no len() (pt packed the stream)
    metrics = train(None, pt_cfg(base_cfg, streaming=True))
    assert metrics["train_loss"] > 0
    assert (Path(base_cfg["output_dir"]) / "adapter_model.safetensors").is_file()


def test_the_main_first_pass_fills_the_cache_entry_the_pt_stage_reads(base_cfg, caplog):
    # before: under torchrun the main-first pass encoded with the user's cutoff_len and pt with another
    from lmstack.data.pipeline import build_datasets
    from lmstack.train.common import tokenizer_and_template
    from lmstack.train.stage_data import encode_config, stage_datasets

    plan = RunPlan.resolve(build_config(pt_cfg(base_cfg, overwrite_cache=False)), LaunchContext())
    tokenizer, template = tokenizer_and_template(plan.cfg)
    build_datasets(encode_config(plan), tokenizer, template)  # what tokenize_on_main_first runs
    caplog.clear()  # only what the stage's own call logs
    with caplog.at_level(logging.INFO, logger="lmstack.data.cache"):
        stage_datasets(plan, tokenizer, template)  # what the stage runs
    assert "reusing tokenized cache" in caplog.text and "cache miss" not in caplog.text


def test_pure_bf16_without_bf16_trains_a_bf16_model(base_cfg):
    # before: pure_bf16 alone loaded and trained float32 weights
    train(None, {**base_cfg, "finetuning_type": "full", "pure_bf16": True, "max_steps": 2})
    with safe_open(str(Path(base_cfg["output_dir"]) / "model.safetensors"), "pt") as f:
        dtypes = {str(f.get_slice(k).get_dtype()) for k in f.keys()}
    assert dtypes == {"BF16"}


def test_the_resolved_plan_is_recorded_with_the_run(base_cfg):
    train(None, {**base_cfg, "packing": True, "max_steps": 2, "include_effective_tokens_per_second": True})
    out = Path(base_cfg["output_dir"])
    manifest = json.loads((out / "run_manifest.json").read_text())
    assert manifest["plan"]["decisions"]["packing"] is True
    assert manifest["plan"]["decisions"]["loss_kernel"] == "chunked"
    assert "packing" in manifest["plan"]["reasons"]
    saved = (out / "lmstack_config.yaml").read_text()
    assert "# run plan" in saved and "#   attention" in saved
    assert yaml.safe_load(saved)["packing"] is True  # the comments leave a loadable config
    results = json.loads((out / "train_results.json").read_text())
    assert results["effective_tokens_per_sec"] > 0


def test_ignore_pad_token_for_loss_false_is_refused(base_cfg):
    with pytest.raises(ConfigError, match="ignore_pad_token_for_loss: false .* not available"):
        train(None, {**base_cfg, "ignore_pad_token_for_loss": False})


def test_upcast_layernorm_keeps_norm_weights_in_fp32(base_cfg):
    from lmstack.models.load import load_model
    from lmstack.train.common import tokenizer_and_template

    cfg = build_config({**base_cfg, "upcast_layernorm": True, "pure_bf16": True})
    with pytest.raises(ConfigError, match="upcast_layernorm: fp32 norm weights in a bf16 model"):
        from lmstack.train import preflight

        preflight.check(RunPlan.resolve(cfg, LaunchContext()))
    plan = RunPlan.resolve(
        build_config({**base_cfg, "upcast_layernorm": True, "bf16": True}), LaunchContext()
    )
    spec = plan.model_spec()
    from dataclasses import replace

    model = load_model(replace(spec, load_dtype="bf16"), tokenizer_and_template(plan.cfg)[0])
    norms = {n: p.dtype for n, p in model.named_parameters() if "norm" in n}
    import torch

    assert norms and set(norms.values()) == {torch.float32}
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16


def test_fsdp_from_the_yaml_field_trains_on_two_processes(base_cfg, tmp_path):
    """`fsdp: full_shard auto_wrap` (LF passes it to the Trainer) through lmstack's torchrun relaunch:
    2 gloo ranks on CPU, the adapter gathered from the shards."""
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    cfg = {
        **base_cfg,
        "fsdp": ["full_shard", "auto_wrap"],
        "use_cpu": True,
        "max_steps": 2,
        "per_device_train_batch_size": 2,
    }
    path = tmp_path / "fsdp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(FORCE_TORCHRUN="1", NPROC_PER_NODE="2", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, "-m", "lmstack.cli", "train", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = Path(cfg["output_dir"])
    manifest = json.loads((out / "run_manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["plan"]["decisions"]["fsdp"] == "FULL_SHARD (yaml)"
    assert len(load_file(out / "adapter_model.safetensors")) == 28  # 2 layers x 7 linears x (A, B)
