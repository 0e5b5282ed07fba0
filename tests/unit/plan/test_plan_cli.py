"""`lmstack plan` on a local config: fast (no torch / transformers / TRL / PEFT import on the plan path)
and its --json gives the figures comparable with torch.cuda's counters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

import lmstack

SRC = str(Path(lmstack.__file__).resolve().parents[1])  # the lmstack under test
HEAVY = ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "deepspeed")
PROBE = """
import io, contextlib, json, sys
from lmstack.cli.main import main
sys.argv = ["lmstack", "plan", sys.argv[1], "--gpus", "1", "--gpu-memory", "24", "--json"]
out = io.StringIO()
with contextlib.redirect_stdout(out):
    main()
print(json.dumps({"plan": json.loads(out.getvalue()), "modules": sorted({m.split(".")[0] for m in sys.modules})}))
"""


def _run(config: Path, env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, str(config)], capture_output=True, text=True, env=env,
                          timeout=120, check=True)  # fmt: skip
    return json.loads(proc.stdout.splitlines()[-1])


def test_plan_answers_fast_without_importing_the_training_stack(base_cfg, tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump({**base_cfg, "cutoff_len": 1024}))
    env = {**os.environ, "PYTHONPATH": SRC, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    _run(config, env)  # the first call tokenizes the (unpacked) data once: the cache training reuses
    # speed is asserted by what the plan path imports (no training stack), not by a wall-clock bound that
    # a loaded machine breaks
    got = _run(config, env)
    assert not set(HEAVY) & set(got["modules"]), set(HEAVY) & set(got["modules"])
    conf = got["plan"]["configured"]
    assert conf["allocated_gib"] <= conf["reserved_gib"] <= conf["per_gpu_gib"]["total"]
    assert got["plan"]["lengths"]["source"].endswith("from the tokenized cache (1 entry)")
