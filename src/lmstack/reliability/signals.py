"""SIGTERM/SIGINT while training: the first only sets a flag (the trainer finishes the step, saves and
stops, see trainer.py); the second aborts at once."""

from __future__ import annotations

import atexit
import functools
import logging
import multiprocessing
import multiprocessing.util  # registers its exit hook now, so the reaper below (registered later) runs first
import os
import signal
import threading
from typing import Any

logger = logging.getLogger(__name__)


class StopSignals:
    """Installs SIGTERM/SIGINT handlers that only set a flag; the second signal aborts."""

    SIGNALS = ("SIGTERM", "SIGINT")

    def __init__(self) -> None:
        self.received = 0  # signal number, 0 = none
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received:
            logger.warning("second %s: stopping now without saving", signal.Signals(signum).name)
            self.restore()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            os.kill(os.getpid(), signum)
            return
        self.received = signum
        logger.warning(
            "%s received: finishing the current step, saving a checkpoint, then exiting "
            "(send it again to stop at once)",
            signal.Signals(signum).name,
        )

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread (e.g. the web UI runs jobs in one)
        for name in self.SIGNALS:
            signum = getattr(signal, name)
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


def workers_ignore_stop_signals(loader: Any) -> Any:
    """DataLoader worker processes ignore SIGTERM/SIGINT, so a signal sent to the whole process group (a
    scheduler's SIGTERM, Ctrl-C) reaches only the main process's flag-only handler. Left alone, torch's
    workers die of a SIGTERM that their parent did not send, and the main process then fails with
    "DataLoader worker ... is killed by signal: Terminated" instead of saving. The workers still stop
    when the main process shuts them down or exits. Returns `loader`."""
    inner = getattr(loader, "base_dataloader", loader)  # accelerate's adapter iterates the one it wraps
    if getattr(inner, "num_workers", 0) > 0:
        inner.worker_init_fn = functools.partial(_ignore_stop_signals, inner.worker_init_fn)
        _reap_workers_at_exit()
    return loader


@functools.cache
def _reap_workers_at_exit() -> None:
    """A worker that ignores SIGTERM outlives torch's `terminate()`: one blocked writing a prefetched batch
    into a pipe its parent no longer reads (the loop stopped on an exception, e.g. a CUDA OOM) would then
    block multiprocessing's own exit hook, which joins every child, and the run would hang after its
    traceback. Registered after that hook, this one runs first (atexit is last-in, first-out) and does
    what the hook would do to daemonic children (data-loader workers are daemonic), with SIGKILL in place
    of the SIGTERM they ignore; they hold nothing that needs saving."""
    atexit.register(_kill_daemonic_children)


def _kill_daemonic_children() -> None:
    children = [child for child in multiprocessing.active_children() if child.daemon]
    if not children:
        return
    # torch's SIGCHLD handler raises in this process when a worker dies of a signal; at exit that is expected
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in children:
        child.kill()
    for child in children:
        child.join(timeout=10)


def _ignore_stop_signals(inner: Any, worker_id: int) -> None:
    for name in StopSignals.SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    if inner is not None:
        inner(worker_id)
