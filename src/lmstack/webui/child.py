"""`python -m lmstack.webui.child RUN_DIR -- CMD...`: the web UI's keeper of one training process.

It runs CMD (`lmstack train ...`) in its own session, so the run outlives the browser tab and the web
UI process; it writes CMD's pid to `RUN_DIR/child.pid`, forwards SIGTERM/SIGINT to it once each (the
reliability layer then saves a checkpoint and exits 143/130), and writes CMD's exit code to
`RUN_DIR/exit_code` when it ends, so any later web UI can tell a finished run from a stopped one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

EXIT_FILE = "exit_code"
PID_FILE = "child.pid"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m lmstack.webui.child RUN_DIR -- CMD...", file=sys.stderr)
        return 2
    run_dir, cmd = Path(argv[0]), argv[2:]
    pending: list[int] = []
    proc: subprocess.Popen | None = None

    def forward(signum: int, frame: object) -> None:
        if proc is None:
            pending.append(signum)
        else:
            proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)  # a Python handler, not SIG_IGN: the child starts with the default
    proc = subprocess.Popen(cmd)
    write_atomic(run_dir / PID_FILE, str(proc.pid))
    for signum in pending:
        proc.send_signal(signum)
    code = proc.wait()
    code = 128 - code if code < 0 else code  # killed by a signal: the shell's 128 + N
    write_atomic(run_dir / EXIT_FILE, str(code))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
