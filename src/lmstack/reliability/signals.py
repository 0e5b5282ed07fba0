"""SIGTERM/SIGINT while training: the first only sets a flag (the trainer finishes the step, saves and
stops, see trainer.py); the second aborts at once."""

from __future__ import annotations

import functools
import logging
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
    return loader


def _ignore_stop_signals(inner: Any, worker_id: int) -> None:
    for name in StopSignals.SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    if inner is not None:
        inner(worker_id)
