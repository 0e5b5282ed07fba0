"""SIGTERM/SIGINT while training: the first only sets a flag (the trainer finishes the step, saves and
stops, see trainer.py); the second aborts at once."""

from __future__ import annotations

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
