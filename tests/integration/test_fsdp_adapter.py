"""FSDP1 + LoRA: the adapter lmstack writes holds every trained tensor and reloads to the same logits.

Through the Trainer, FSDP + LoRA saved an adapter with 0 tensors on 2 x H200 (2026-11-29): PEFT picks
the adapter entries by module names, which FSDP prefixes with `_fsdp_wrapped_module.`. The same
sharding runs here on CPU (FSDP with gloo, 2 ranks, PEFT's FSDP wrap policy)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("mode", ["fsdp1", "fsdp2"])
def test_fsdp_lora_adapter_is_gathered_and_reloads(tiny_model, tmp_path, mode):
    from lmstack.launch.torchrun import free_port

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(HERE / "_fsdp_adapter_worker.py"), str(tiny_model), str(tmp_path / "adapter"), mode]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    (tmp_path / "stderr.txt").write_text(proc.stderr)
    (tmp_path / "stdout.txt").write_text(proc.stdout)
    assert proc.returncode == 0, proc.stderr[:3000]
    assert "SHARDED True" in proc.stdout.splitlines()
    result = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    assert result == "RESULT 8 True"  # 2 layers x (q, v) x (A, B) tensors, reload matches
    lines = proc.stdout.splitlines()
    assert "RESUMED 8 True" in lines  # the overwritten shards got the saved adapter back
    assert "REFUSED True" in lines  # a file missing a tensor is refused, naming the count
