"""Child processes of the benchmark scripts: each in its own session (data-loader workers and ranks
included), output to a log, killed as a group on timeout, the `RESULT {json}` line read back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path


def run_killable(cmd: list[str], env: dict, timeout: float, log_path: Path) -> int:
    """Exit code of `cmd`, or 124 after killing its whole process group at `timeout` seconds."""
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            log.write(f"\nTIMEOUT after {timeout:.0f}s\n")
            return 124


def result_from_log(log_path: Path) -> dict | None:
    """The last `RESULT {json}` line a child printed, or None."""
    result = None
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
    return result
