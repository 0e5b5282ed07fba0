"""Test driver for test_reliability.py: runs `lmstack train <args>` with one test-only hook so the
test can kill or signal the process at a known point. Not a test module (no test_ prefix).

LMSTACK_TEST_HOOK:
  block:N         block (forever) at the start of step N+1, after checkpoint-N is committed
  save_block:N    block while checkpoint-N is saved: files written to staging, no manifest yet
  signal_wait:N   on rank LMSTACK_TEST_RANK (default 0), at the start of step N+1 wait until a
                  signal has been received (the test sends it), then go on
LMSTACK_TEST_FLAG: file written (with the pid) when the hook point is reached.
"""

import os
import sys
import time
from pathlib import Path


def reached() -> None:
    flag = Path(os.environ["LMSTACK_TEST_FLAG"])
    flag.with_suffix(".tmp").write_text(str(os.getpid()))
    os.replace(flag.with_suffix(".tmp"), flag)


def install(hook: str) -> None:
    kind, n = hook.split(":")
    n = int(n)
    if kind == "save_block":
        from lmstack.reliability import checkpoint

        def write_manifest(folder, meta=None):
            if (meta or {}).get("step") == n:
                reached()
                time.sleep(600)
            return original(folder, meta)

        original = checkpoint.write_manifest
        checkpoint.write_manifest = write_manifest  # commit_checkpoint looks it up at call time
        return

    from transformers import Trainer

    original_step = Trainer.training_step  # under every stage's trainer (TRL's call it via super)
    rank = os.environ.get("RANK", "0")
    target = os.environ.get("LMSTACK_TEST_RANK", "0")

    def training_step(self, *args, **kwargs):
        if kind == "block" and self.state.global_step >= n:
            reached()
            time.sleep(600)
        if kind == "signal_wait" and self.state.global_step == n and rank == target:
            if not getattr(self, "_test_waited", False):
                self._test_waited = True
                reached()
                deadline = time.time() + 120
                while not self._lm_signals.received and time.time() < deadline:
                    time.sleep(0.05)
        return original_step(self, *args, **kwargs)

    Trainer.training_step = training_step


if __name__ == "__main__":
    if os.environ.get("LMSTACK_TEST_HOOK"):
        install(os.environ["LMSTACK_TEST_HOOK"])
    from lmstack.cli.main import main

    sys.exit(main(["train", *sys.argv[1:]]))
