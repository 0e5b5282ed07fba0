"""One training run per output_dir: an exclusive fcntl.flock held for the life of the process.

The lock file sits next to output_dir (`.<name>.lmstack-lock` in its parent), not inside it, so the
"output_dir must be empty" rule and overwrite_output_dir never see it. The OS drops the lock when the
process exits or is killed, so a stale file never blocks a later run; the pid written into it names the
holder in the refusal. Under torchrun only the launcher (or rank 0 of an external launch) locks: the
environment variable it sets tells its workers the run already holds it."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from lmstack.config.errors import ConfigError

HELD_ENV = "LMSTACK_OUTPUT_LOCK_HELD"
_HELD: list[int] = []  # fds kept open for the process's life (closing one would drop its lock)


def lock_path(output_dir: str | Path) -> Path:
    out = Path(output_dir).absolute()
    return out.parent / f".{out.name}.lmstack-lock"


def _writable_dir(out: Path) -> None:
    """An output_dir that cannot be written is refused now, not after the model has loaded. output_dir
    itself is not created here (a job that fails before any worker starts leaves nothing behind): its
    parent is, which holds the lock file; an existing output_dir must be a writable folder."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir: {out} is a file, not a folder; choose another output_dir")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"output_dir: cannot create {out.parent} ({err.strerror})") from None
    where = out if out.exists() else out.parent
    if not os.access(where, os.W_OK | os.X_OK):
        raise ConfigError(f"output_dir: {where} is not writable; fix its permissions or choose another")


def acquire(output_dir: str | Path, is_main: bool = True) -> Path | None:
    """Lock `output_dir` for this run (None: a launcher's worker other than rank 0, or a worker whose
    launcher holds the lock). `is_main` is the launch context's rank-0 answer (the run plan's ctx)."""
    out = Path(output_dir).absolute()
    if os.environ.get(HELD_ENV) == str(out) or not is_main:
        return None
    _writable_dir(out)
    path = lock_path(out)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise ConfigError(f"output_dir: cannot create the run lock {path} ({err.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(
            f"output_dir: {out} is in use by another lmstack run (pid {holder}); wait for it to finish, "
            "stop it, or choose another output_dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _HELD.append(fd)
    os.environ[HELD_ENV] = str(out)
    return path
