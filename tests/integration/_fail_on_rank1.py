"""Test-only entry for test_distributed: `lmstack train` where rank 1 raises in its 2nd step.

The failure is injected here, by patching the Trainer in this worker process only; nothing of it
exists in the product code.
"""

import os
import sys

from transformers import Trainer

from lmstack.cli.main import main

_original = Trainer.training_step


def _failing_step(self, *args, **kwargs):
    if os.environ.get("RANK") == "1" and self.state.global_step >= 1:
        raise RuntimeError("injected failure on rank 1")
    return _original(self, *args, **kwargs)


Trainer.training_step = _failing_step
sys.exit(main(sys.argv[1:]))
