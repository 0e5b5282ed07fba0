"""GPU: plan.allocator applied (issues 20 and 19). An unpacked LoRA SFT run, padded rows whose width changes
from batch to batch, trained with the plan's decision (expandable segments, set in train/run.py before the
model loads) reserves less than 1.15x what it allocates; the same run with the default allocator forced by
the environment (the user's variable wins) shows the fragmentation the decision removes. Each run is its
own process, so the allocator starts fresh."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
REPO = Path(__file__).resolve().parents[2]
WORDS = "the model learns from data and every answer follows the question in a few clear words".split()
CHILD = """
import json, logging, sys, torch
from lmstack.train.run import train
logging.basicConfig(level=logging.INFO, stream=sys.stderr)  # the run plan's lines (the CLI sets this up)
train(None, json.loads(sys.argv[1]))
torch.cuda.synchronize()
get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
print("PEAKS " + json.dumps({"allocated": torch.cuda.max_memory_allocated(),
                             "reserved": torch.cuda.max_memory_reserved(), "settings": get() if get else None}))
"""


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> tuple[Path, Path]:
    """A 12-layer model of Qwen2.5-0.5B's widths and rows of 20 to ~1900 tokens (random lengths)."""
    from lmstack.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("alloc")
    model = build_tiny_model(root / "model", data_dir=REPO / "data", hidden_size=896, intermediate_size=4864,
                             num_hidden_layers=12, num_attention_heads=14, num_key_value_heads=2)  # fmt: skip
    rng = random.Random(0)
    texts = [" ".join(rng.choices(WORDS, k=rng.randint(10, 900))) for _ in range(400)]
    rows = [{"instruction": "Say it again.", "input": "", "output": text} for text in texts]
    data = root / "data"
    data.mkdir()
    (data / "varlen.json").write_text(json.dumps(rows))
    (data / "dataset_info.json").write_text(json.dumps({"varlen": {"file_name": "varlen.json"}}))
    return model, data


def _run(assets, tmp_path: Path, name: str, **env_extra: str) -> tuple[dict, str]:
    model, data = assets
    cfg = {
        "model_name_or_path": str(model), "template": "qwen", "stage": "sft", "do_train": True,
        "finetuning_type": "lora", "lora_target": "all", "lora_rank": 8, "dataset": "varlen",
        "dataset_dir": str(data), "cutoff_len": 2048, "packing": False, "per_device_train_batch_size": 8,
        "max_steps": 30, "learning_rate": 1e-4, "bf16": True, "flash_attn": "sdpa", "logging_steps": 10,
        "save_strategy": "no", "report_to": "none", "disable_tqdm": True, "seed": 0,
        "output_dir": str(tmp_path / name),
    }  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", XDG_CACHE_HOME=str(tmp_path / "xdg"))
    env.update(env_extra)
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], env=env, capture_output=True,
                          text=True, timeout=500)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("PEAKS "))
    return json.loads(line[len("PEAKS ") :]), proc.stderr


def test_unpacked_run_with_the_plans_allocator_reserves_little_more_than_it_allocates(assets, tmp_path):
    on, log = _run(assets, tmp_path, "on")
    plan_line = next(x for x in log.splitlines() if x.strip().startswith("allocator"))
    assert "expandable_segments" in plan_line and "not packed" in plan_line, plan_line
    if on["settings"] is not None:
        assert "expandable_segments:True" in on["settings"], on["settings"]
    ratio = on["reserved"] / on["allocated"]
    default, log = _run(assets, tmp_path, "default", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:False")
    assert "in the environment kept" in log
    ratio_default = default["reserved"] / default["allocated"]
    report = (
        f"expandable segments: {on['reserved'] / 2**30:.2f} GiB reserved / {on['allocated'] / 2**30:.2f} allocated "
        f"= {ratio:.3f}; default allocator: {ratio_default:.3f}"
    )
    print(report)
    assert ratio < 1.15, report
    # the workload fragments the default allocator (else this test could not tell the decision apart)
    assert ratio_default > ratio, report
