"""`lmstack` as a user runs it: a subprocess of this checkout's CLI, offline, output captured."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def lmstack(*args: str, cwd: Path, stdin: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "lmstack.cli.main", *args],
        cwd=cwd, env=env, input=stdin, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
