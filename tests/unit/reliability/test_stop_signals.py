"""The signal handler only records the request; a second signal stops at once; handlers are restored."""

from __future__ import annotations

import os
import signal

import pytest

from lmstack.reliability import EXIT_CODES, TrainingStopped
from lmstack.reliability.trainer import StopSignals


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_first_signal_sets_the_flag_second_aborts(name):
    signum = getattr(signal, name)
    before = signal.getsignal(signum)
    stop = StopSignals()
    stop.install()
    try:
        os.kill(os.getpid(), signum)
        assert stop.received == signum  # recorded, the process goes on
        if name == "SIGINT":
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signum)
            assert signal.getsignal(signum) is before  # restored before raising
    finally:
        stop.restore()
    assert signal.getsignal(signum) is before
    assert EXIT_CODES[name] == 128 + signum


def test_stopped_error_carries_the_exit_code():
    err = TrainingStopped("stopped by SIGTERM after step 5", exit_code=143)
    assert err.exit_code == 143 and "step 5" in str(err)
