"""GPU: partial gradient checkpointing chosen by the planner (plan.checkpoint_layers, issues 19 and 20). A
12-layer model of Qwen2.5-0.5B's widths, packed LoRA SFT 8 x 2048, `gradient_checkpointing: auto`, planned
for a GPU budget halfway between the planner's all-checkpointed and no-checkpointing peaks: the run plan
checkpoints k of the 12 layers (0 < k < 12), and the measured peak stays under the budget and within the
planner's accuracy target of its prediction (no under-prediction > 5%, error <= 10%). Each run is its own
process (a fresh allocator); the budget is given to the run plan through the launch context."""

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
LAYERS = 12
WORDS = "the model learns from data and every answer follows the question in a few clear words".split()
CHILD = """
import json, sys
from dataclasses import replace
import torch
from lmstack.config.load import load_config
from lmstack.launch import prepare
from lmstack.launch.context import LaunchContext
from lmstack.memory import plan as plan_setups
from lmstack.plan.from_config import request_from_plan
from lmstack.train import STAGES
from lmstack.train.run import apply_allocator, plan_run
from lmstack.train.stage_data import tokenize_on_main_first

cfg, budget = load_config(None, json.loads(sys.argv[1])), float(sys.argv[2])
p, notes = plan_run(cfg, replace(LaunchContext.from_env(), gpu_memory_gib=budget))
predicted = plan_setups(request_from_plan(p, 1, budget)).configured.estimate.gpu.allocated
apply_allocator(p)
prepare.prepare_worker(p, notes)
tokenize_on_main_first(p)
STAGES[p.stage.name](p)
torch.cuda.synchronize()
print("PEAKS " + json.dumps({"allocated": torch.cuda.max_memory_allocated() / 2**30, "predicted": predicted,
                             "checkpoint_layers": p.checkpoint_layers, "checkpointing": p.checkpointing,
                             "offload": p.checkpoint_offload}))
"""


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> tuple[Path, Path]:
    from lmstack.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("partial")
    model = build_tiny_model(root / "model", data_dir=REPO / "data", hidden_size=896, intermediate_size=4864,
                             num_hidden_layers=LAYERS, num_attention_heads=14, num_key_value_heads=2)  # fmt: skip
    rng = random.Random(0)
    rows = [
        {
            "instruction": "Say it again.",
            "input": "",
            "output": " ".join(rng.choices(WORDS, k=rng.randint(200, 900))),
        }
        for _ in range(600)
    ]
    data = root / "data"
    data.mkdir()
    (data / "rows.json").write_text(json.dumps(rows))
    (data / "dataset_info.json").write_text(json.dumps({"rows": {"file_name": "rows.json"}}))
    return model, data


def config(assets, out: Path) -> dict:
    model, data = assets
    return {
        "model_name_or_path": str(model), "template": "qwen", "stage": "sft", "do_train": True,
        "finetuning_type": "lora", "lora_target": "all", "dataset": "rows", "dataset_dir": str(data),
        "cutoff_len": 2048, "packing": True, "per_device_train_batch_size": 8, "max_steps": 6,
        "learning_rate": 1e-4, "bf16": True, "save_strategy": "no", "report_to": "none", "disable_tqdm": True,
        "seed": 0, "output_dir": str(out),
    }  # fmt: skip


def budget_between_full_and_none(cfg: dict) -> float:
    """GiB halfway between the planner's peaks with every layer and with no layer checkpointed (offloaded
    when cfg has use_unsloth_gc)."""
    from lmstack.config.load import build_config
    from lmstack.memory import memory as mem
    from lmstack.memory import plan
    from lmstack.plan.whatif import request_from_config

    totals = {}
    for gc in (True, False):
        over = (
            {"gradient_checkpointing": gc}
            if gc
            else {"gradient_checkpointing": False, "use_unsloth_gc": False}
        )
        req = request_from_config(build_config({**cfg, **over}), 1, 1000)
        totals[gc] = plan(req).configured.estimate.gpu.total
    return (totals[True] + totals[False]) / 2 / mem.SAFETY_MARGIN


@pytest.mark.parametrize("offload", [False, True], ids=["recompute", "use_unsloth_gc"])
def test_partial_run_fits_its_budget_and_matches_the_planner(assets, tmp_path, offload):
    """use_unsloth_gc under auto: the recomputed layers' inputs wait in CPU RAM, the others keep theirs."""
    cfg = config(assets, tmp_path / "out")
    if offload:
        cfg["use_unsloth_gc"] = True
    budget = budget_between_full_and_none(cfg)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg), str(budget)], env=env,
                          capture_output=True, text=True, timeout=500)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("PEAKS "))[len("PEAKS ") :])
    err = (got["predicted"] - got["allocated"]) / got["allocated"]
    report = (
        f"budget {budget:.2f} GiB: checkpointing {got['checkpoint_layers']} of {LAYERS} layers; measured "
        f"{got['allocated']:.2f} GiB allocated, predicted {got['predicted']:.2f} ({err:+.1%})"
    )
    print(report)
    assert got["checkpointing"] and got["checkpoint_layers"] is not None, report
    assert got["offload"] is offload, report
    assert 0 < got["checkpoint_layers"] < LAYERS, report
    assert got["allocated"] < budget, report
    assert err > -0.05 and abs(err) <= 0.10, report
