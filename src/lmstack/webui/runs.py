"""Training runs started from the web UI, tracked on disk by output_dir, so they outlive the page.

`SHARE_DIR/runs/<key>/` (the key is made from output_dir) holds `config.yaml` (the YAML the run was
started with), `run.json` (output_dir, start time, the keeper's pid and its start time), `train.log`
(the run's stdout and stderr, one header line per start) and, once it ended, `exit_code` (written by
`lmstack.webui.child`). Progress, the loss curve and ETA are read from `output_dir/trainer_log.jsonl`,
the file `lmstack train` writes every `logging_steps`; any web UI on the same share dir sees them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmstack.config import secrets
from lmstack.config.errors import ConfigError
from lmstack.webui.child import EXIT_FILE, PID_FILE, write_atomic
from lmstack.webui.fields import to_yaml

CONFIG_NAME, META_NAME, LOG_NAME = "config.yaml", "run.json", "train.log"
TRAINER_LOG = "trainer_log.jsonl"  # lmstack.train.common.LOG_FILE
STOPPED = {143: "SIGTERM", 130: "SIGINT"}


@dataclass
class RunView:
    output_dir: str
    state: str  # running | finished | stopped | failed | lost | none (never started from a web UI)
    exit_code: int | None = None
    started: float | None = None
    step: int = 0
    total: int = 0
    percentage: float = 0.0
    elapsed: str = ""
    remaining: str = ""
    tokens_per_sec: float | None = None
    loss: list[tuple[int, float]] = field(default_factory=list)
    eval_loss: list[tuple[int, float]] = field(default_factory=list)
    log_tail: str = ""
    gpu_memory: str = ""


def run_key(output_dir: str) -> str:
    path = Path(output_dir).expanduser().absolute()
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", path.name)[:40] or "run"
    return f"{name}-{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"


def process_start(pid: int) -> str | None:
    """The process's start time in clock ticks (/proc); None when it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def alive(pid: int | None, start: str | None) -> bool:
    if not pid:
        return False
    if not Path("/proc").is_dir():  # no procfs: a signal-0 probe (pid reuse cannot be told apart)
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True
    now = process_start(pid)
    return now is not None and (start is None or now == start)


def read_trainer_log(output_dir: Path) -> list[dict]:
    path = output_dir / TRAINER_LOG
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # a line being written right now
    return records


def _seconds(hms: str) -> int:
    try:
        h, m, s = (int(x) for x in hms.split(":"))
    except (AttributeError, ValueError):
        return 0
    return h * 3600 + m * 60 + s


def tokens_per_second(records: list[dict]) -> float | None:
    """Trained tokens per second over the latest start (elapsed_time restarts on a resume)."""
    first = len(records) - 1
    while first > 0 and _seconds(records[first - 1].get("elapsed_time", "")) <= _seconds(
        records[first].get("elapsed_time", "")
    ):
        first -= 1
    a, b = records[first] if records else {}, records[-1] if records else {}
    seconds = _seconds(b.get("elapsed_time", "")) - _seconds(a.get("elapsed_time", ""))
    tokens = (b.get("total_tokens") or 0) - (a.get("total_tokens") or 0)
    return round(tokens / seconds, 1) if seconds > 0 and tokens > 0 else None


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def terminal_text(text: str) -> str:
    """What a terminal would show of a log: each tqdm bar's last frame (the text after its last
    carriage return), without cursor moves and colours (ESC[A and the like were shown as boxes)."""
    lines = []
    for line in _ANSI.sub("", text).split("\n"):
        frames = [f for f in line.split("\r") if f.strip()]
        lines.append(frames[-1] if frames else "")
    return "\n".join(lines)


def tail(path: Path, lines: int = 40, limit: int = 65536) -> str:
    if not path.is_file():
        return ""
    with path.open("rb") as fh:
        fh.seek(max(path.stat().st_size - limit, 0))
        text = fh.read().decode("utf-8", errors="replace")
    return "\n".join(terminal_text(text).splitlines()[-lines:])


def gpu_memory() -> str:
    """Used / total memory per GPU from nvidia-smi ('' without a GPU)."""
    if shutil.which("nvidia-smi") is None:
        return ""
    query = ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=5, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    rows = [r.split(",") for r in out.strip().splitlines() if "," in r]
    return ", ".join(f"GPU{i} {int(u) / 1024:.1f}/{int(t) / 1024:.0f} GiB" for i, (u, t) in enumerate(rows))


class RunRegistry:
    def __init__(self, share_dir: str | Path):
        self.root = Path(share_dir).expanduser() / "runs"
        self._procs: dict[str, subprocess.Popen] = {}  # keepers started by this process (reaped here)

    def run_dir(self, output_dir: str) -> Path:
        return self.root / run_key(output_dir)

    def meta(self, output_dir: str) -> dict[str, Any] | None:
        path = self.run_dir(output_dir) / META_NAME
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def is_running(self, output_dir: str) -> bool:
        key = run_key(output_dir)
        if key in self._procs:
            self._procs[key].poll()  # reap a keeper that ended, so its pid is not a zombie
        meta = self.meta(output_dir) or {}
        done = (self.run_dir(output_dir) / EXIT_FILE).is_file()
        return not done and alive(meta.get("pid"), meta.get("pid_start"))

    def start(self, flat: dict[str, Any], resume: bool = False) -> Path:
        """Starts `lmstack train` on `flat` (resume: with resume_from_checkpoint: auto) under the keeper;
        returns the run folder. Refuses a second run into the same output_dir."""
        output_dir = str(flat.get("output_dir") or "")
        if not output_dir:
            raise ConfigError("output_dir: required to start a run; set output_dir: <folder for the outputs>")
        if self.is_running(output_dir):
            pid = (self.meta(output_dir) or {}).get("pid")
            raise ConfigError(
                f"output_dir: a run is already training into {output_dir} (pid {pid}); stop it first"
            )
        if resume:
            flat = {**flat, "resume_from_checkpoint": "auto"}
        run_dir = self.run_dir(output_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        for name in (EXIT_FILE, PID_FILE):
            (run_dir / name).unlink(missing_ok=True)
        config = run_dir / CONFIG_NAME
        secrets.write_text(config, to_yaml(flat), private=secrets.holds_secret(flat))
        train = [sys.executable, "-m", "lmstack.cli", "train", str(config)]
        cmd = [sys.executable, "-m", "lmstack.webui.child", str(run_dir), "--", *train]
        with (run_dir / LOG_NAME).open("a", encoding="utf-8") as log:
            log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {'resume' if resume else 'start'}: ")
            log.write(" ".join(train) + "\n")
            log.flush()
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self._procs[run_key(output_dir)] = proc
        meta = {
            "output_dir": output_dir,
            "output_path": str(Path(output_dir).expanduser().absolute()),
            "started": time.time(),
            "pid": proc.pid,
            "pid_start": process_start(proc.pid),
            "resume": resume,
        }
        write_atomic(run_dir / META_NAME, json.dumps(meta, indent=2))
        return run_dir

    def stop(self, output_dir: str) -> bool:
        """SIGTERM to the run (the keeper forwards it to `lmstack train`, which saves and exits 143)."""
        if not self.is_running(output_dir):
            return False
        os.kill(int((self.meta(output_dir) or {})["pid"]), signal.SIGTERM)
        return True

    def wait(self, output_dir: str, timeout: float) -> int | None:
        """The exit code once the run ended (None at the timeout)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if not self.is_running(output_dir):
                return self.exit_code(output_dir)
            time.sleep(0.2)
        return None

    def exit_code(self, output_dir: str) -> int | None:
        try:
            return int((self.run_dir(output_dir) / EXIT_FILE).read_text())
        except (OSError, ValueError):
            return None

    def state(self, output_dir: str) -> tuple[str, int | None]:
        if self.is_running(output_dir):
            return "running", None
        code = self.exit_code(output_dir)
        if code is not None:
            return ("finished" if code == 0 else "stopped" if code in STOPPED else "failed"), code
        return ("lost" if self.meta(output_dir) else "none"), None

    def view(self, output_dir: str) -> RunView:
        meta = self.meta(output_dir) or {}
        state, code = self.state(output_dir)
        out = Path(meta.get("output_path") or Path(output_dir).expanduser())
        records = read_trainer_log(out)
        last = records[-1] if records else {}
        view = RunView(output_dir, state, code, meta.get("started"))
        view.step, view.total = last.get("current_steps", 0), last.get("total_steps", 0)
        view.percentage = last.get("percentage", 0.0)
        view.elapsed, view.remaining = last.get("elapsed_time", ""), last.get("remaining_time", "")
        view.tokens_per_sec = tokens_per_second(records)
        view.loss = [(r["current_steps"], r["loss"]) for r in records if r.get("loss") is not None]
        view.eval_loss = [
            (r["current_steps"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None
        ]
        view.log_tail = tail(self.run_dir(output_dir) / LOG_NAME)
        view.gpu_memory = gpu_memory() if state == "running" else ""
        return view

    def list_runs(self) -> list[dict[str, Any]]:
        """Every run on this share dir, newest first: [{output_dir, started, state}]."""
        metas = []
        for path in self.root.glob(f"*/{META_NAME}"):
            try:
                metas.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        metas.sort(key=lambda m: m.get("started", 0), reverse=True)
        return [{**m, "state": self.state(m["output_dir"])[0]} for m in metas if m.get("output_dir")]
