"""GPU (one H200 is enough): DeepSpeed ZeRO-2/3/3+offload and FSDP through lmstack's launch paths,
LoRA and full SFT for 20 steps each on the tiny model; a ZeRO-3 LoRA save that gathers real weights;
the flash_attn and Liger switches. Speed and memory of the same matrix on a 0.5B model:
bench/distributed_bench.py."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
STEPS = 20
needs_ds = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")


def _cfg(base_cfg: dict, tmp_path: Path, name: str, **over) -> Path:
    cfg = {
        **base_cfg,
        "output_dir": str(tmp_path / name),
        "bf16": True,
        "max_steps": STEPS,
        "cutoff_len": 128,
        "per_device_train_batch_size": 4,
        "save_strategy": "no",
        **over,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _env(tmp_path: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(
        HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", XDG_CACHE_HOME=str(tmp_path / "xdg"), **extra
    )
    return env


def _losses(out: Path) -> list[float]:
    rows = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines() if x.strip()]
    return [r["loss"] for r in rows if "loss" in r]


def _run(cmd, env) -> subprocess.CompletedProcess:
    """The launch's output goes to files, not pipes: `subprocess.run(capture_output=True)` waits for every
    process holding the pipe, so a grandchild that outlives the launch (a data-loader worker, a compile
    worker) would hang the test with the run itself finished; the returned stderr is the file's text."""
    out_dir = Path(env["XDG_CACHE_HOME"]).parent
    stem = f"launch_{len(list(out_dir.glob('launch_*.err')))}"
    with open(out_dir / f"{stem}.out", "w") as out, open(out_dir / f"{stem}.err", "w") as err:
        proc = subprocess.run(cmd, env=env, stdout=out, stderr=err, text=True, timeout=300)
    stdout, stderr = (out_dir / f"{stem}.out").read_text(), (out_dir / f"{stem}.err").read_text()
    assert proc.returncode == 0, stderr[-4000:]
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


METHODS = {
    "lora": {"finetuning_type": "lora", "learning_rate": 5e-3},
    "full": {"finetuning_type": "full", "learning_rate": 1e-3},
}


@needs_ds
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("ds", ["ds_z2_config.json", "ds_z3_config.json", "ds_z3_offload_config.json"])
def test_deepspeed_sft_through_the_relaunch(base_cfg, tmp_path, ds, method):
    cfg = _cfg(base_cfg, tmp_path, "run", deepspeed=str(REPO / "examples/deepspeed" / ds), **METHODS[method])
    env = _env(tmp_path, FORCE_TORCHRUN="1", NPROC_PER_NODE="1", TORCH_CUDA_ARCH_LIST="9.0a")
    proc = _run([sys.executable, "-m", "lmstack.cli", "train", str(cfg)], env)
    assert "child command:" in proc.stderr
    assert "TORCH_CUDA_ARCH_LIST: '9.0a' -> '9.0'" in proc.stderr
    curve = _losses(tmp_path / "run")
    assert len(curve) == STEPS and all(math.isfinite(x) for x in curve)
    assert sum(curve[-5:]) / 5 < sum(curve[:5]) / 5, curve
    out = tmp_path / "run"
    saved = out / ("adapter_model.safetensors" if method == "lora" else "model.safetensors")
    from safetensors.torch import load_file

    weights = load_file(saved)
    assert weights and all(t.numel() > 0 for t in weights.values())  # ZeRO-3 gathered real weights


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("config", ["fsdp_config.yaml", "fsdp2_config.yaml"])
def test_fsdp_sft_through_accelerate_launch(base_cfg, tmp_path, config, method):
    cfg = _cfg(base_cfg, tmp_path, "run", **METHODS[method])
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "examples/accelerate" / config),
        "--num_processes", "1", "-m", "lmstack.cli", "train", str(cfg),
    ]  # fmt: skip
    proc = _run(cmd, _env(tmp_path))
    assert "FSDP: wrapping each Qwen2DecoderLayer" in proc.stderr
    curve = _losses(tmp_path / "run")
    assert len(curve) == STEPS and all(math.isfinite(x) for x in curve)
    assert sum(curve[-5:]) / 5 < sum(curve[:5]) / 5, curve


@pytest.mark.parametrize("config", ["fsdp_config.yaml", "fsdp2_config.yaml"])
def test_fsdp_lora_checkpoint_adapter_and_resume(base_cfg, tmp_path, config):
    """FSDP + LoRA through accelerate launch: checkpoint-10's adapter holds every trained tensor (the
    Trainer's own FSDP save wrote none on 2 x H200), and a run resumed from it continues the loss curve
    of the uninterrupted run and ends with the same adapter."""
    import torch
    from safetensors.torch import load_file

    nproc = os.environ.get("LMSTACK_GPU_NPROC", "1")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              str(REPO / "examples/accelerate" / config), "--num_processes", nproc, "-m", "lmstack.cli", "train"]  # fmt: skip
    whole = _cfg(base_cfg, tmp_path, "whole", save_strategy="steps", save_steps=10, **METHODS["lora"])
    _run([*launch, str(whole)], _env(tmp_path))
    checkpoint = tmp_path / "whole" / "checkpoint-10"
    saved = load_file(checkpoint / "adapter_model.safetensors")
    assert saved and all(t.numel() > 0 for t in saved.values())
    assert all(t.abs().sum() > 0 for k, t in saved.items() if "lora_B" in k), "checkpoint lora_B not trained"
    resumed = _cfg(base_cfg, tmp_path, "resumed", resume_from_checkpoint=str(checkpoint), **METHODS["lora"])
    proc = _run([*launch, str(resumed)], _env(tmp_path))
    assert "adapter tensors loaded from" in proc.stderr
    first, second = _losses(tmp_path / "whole"), _losses(tmp_path / "resumed")
    assert len(second) == STEPS - 10, second
    # a fresh adapter (lora_B = 0) would restart near step 1's loss; bf16 sharded sums allow small drift
    assert second == pytest.approx(first[10:], rel=2e-2), (first, second)
    end_whole = load_file(tmp_path / "whole" / "adapter_model.safetensors")
    end_resumed = load_file(tmp_path / "resumed" / "adapter_model.safetensors")
    assert end_whole.keys() == end_resumed.keys()
    for key, tensor in end_whole.items():
        torch.testing.assert_close(end_resumed[key].float(), tensor.float(), atol=2e-3, rtol=5e-2)


@needs_ds
def test_zero3_lora_save_gathers_real_weights_and_reloads(base_cfg, tmp_path, tiny_model):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cfg = _cfg(
        base_cfg,
        tmp_path,
        "z3",
        deepspeed=str(REPO / "examples/deepspeed/ds_z3_config.json"),
        bf16=False,  # fp32 end to end: the reloaded outputs must match the trained model's closely
        **METHODS["lora"],
    )
    logits_file = tmp_path / "trained_logits.pt"
    from lmstack.launch.torchrun import free_port

    nproc = os.environ.get("LMSTACK_GPU_NPROC", "1")  # 2 on a two-GPU machine: the gather spans both ranks
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", nproc, "--master_port", str(free_port()),
           str(HERE / "_zero3_logits_worker.py"), str(cfg), str(logits_file)]  # fmt: skip
    _run(cmd, _env(tmp_path))
    out = tmp_path / "z3"
    weights = load_file(out / "adapter_model.safetensors")
    rank = 8
    assert weights and all(t.numel() > 0 for t in weights.values()), {k: t.shape for k, t in weights.items()}
    assert all(t.shape[0] == rank for k, t in weights.items() if "lora_A" in k)
    assert all(t.shape[1] == rank for k, t in weights.items() if "lora_B" in k)
    assert all(t.abs().sum() > 0 for k, t in weights.items() if "lora_B" in k), "lora_B not trained"
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).cuda()
    model = PeftModel.from_pretrained(base, out).eval()
    ids = torch.load(logits_file)["input_ids"].cuda()
    with torch.no_grad():
        got = model(ids).logits.float().cpu()
    expected = torch.load(logits_file)["logits"]
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)


def test_flash_attn_auto_and_liger_switches_on_gpu(base_cfg, tmp_path, caplog):
    import logging

    from lmstack.train.run import train

    cfg = {**base_cfg, "output_dir": str(tmp_path / "liger"), "bf16": True, "max_steps": STEPS,
           "flash_attn": "auto", "enable_liger_kernel": True}  # fmt: skip
    with caplog.at_level(logging.INFO):
        train(None, cfg)
    has_fa2 = importlib.util.find_spec("flash_attn") is not None
    # the run plan's attention line: its decision and its reason
    want = (
        ("flash_attention_2", "flash-attn is installed") if has_fa2 else ("sdpa", "flash-attn not installed")
    )
    assert any(
        want[0] in line and f"flash_attn: auto, {want[1]}" in line for line in caplog.text.splitlines()
    )
    if importlib.util.find_spec("liger_kernel") is not None:
        assert (
            "enable_liger_kernel: Liger kernels applied to qwen2 (fused linear cross-entropy)" in caplog.text
        )
    else:
        assert "pip install liger-kernel" in caplog.text
    curve = _losses(tmp_path / "liger")
    assert len(curve) == STEPS and sum(curve[-5:]) < sum(curve[:5])


def test_fa2_missing_names_the_install_on_gpu(base_cfg, tmp_path):
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn installed")
    from lmstack.config.errors import ConfigError
    from lmstack.train.run import train

    with pytest.raises(ConfigError, match="pip install flash-attn"):
        train(None, {**base_cfg, "output_dir": str(tmp_path / "fa2"), "flash_attn": "fa2", "bf16": True})


def test_env_allreduce_check_on_the_visible_gpu():
    from lmstack.cli.env import allreduce_check

    ok, message = allreduce_check(1)
    assert ok, message
    assert "NCCL all-reduce OK on 1 GPUs" in message
