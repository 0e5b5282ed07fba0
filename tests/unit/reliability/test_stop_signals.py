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


EXITS_AFTER_A_FAILED_STEP = """
import torch
from torch.utils.data import DataLoader, Dataset
from lmstack.reliability.signals import workers_ignore_stop_signals

class Big(Dataset):  # 1 MiB rows: a prefetched batch never fits the pipe, so its worker blocks writing it
    def __len__(self):
        return 64
    def __getitem__(self, i):
        return torch.zeros(2**18)

it = iter(workers_ignore_stop_signals(DataLoader(Big(), batch_size=4, num_workers=2)))
next(it)
raise RuntimeError("the step failed (a CUDA OOM on the GPU)")
"""


def test_a_run_whose_loop_fails_with_blocked_workers_exits(tmp_path):
    """Workers ignore SIGTERM (a process-group signal must not kill them), so torch's `terminate()` cannot
    stop one blocked on a full pipe, and multiprocessing's exit hook would join it forever: a run that
    OOMed hung after its traceback (seen on the H200 in the planner's accuracy runs). The process exits
    with the error; the timeout only bounds a regression."""
    import subprocess
    import sys

    script = tmp_path / "fails.py"
    script.write_text(EXITS_AFTER_A_FAILED_STEP)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "the step failed" in proc.stderr
    assert "Exception ignored in atexit" not in proc.stderr
