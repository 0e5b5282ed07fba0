"""Reliability and safety: atomic checkpoints with a manifest, resume selection, signal-triggered
saves, the non-finite loss policy and the run manifest (secret redaction: lmstack.config.secrets).

Modules (no import-time side effects):
  checkpoint  manifest.json written last; staging dir + rename; verify; pick the newest complete one
  trainer     `ReliableMixin` (stages' static trainer classes): staged saves, SIGTERM/SIGINT stop, on_nonfinite, safe loads
  manifest    run_manifest.json: resolved config, versions, data hashes, git commit, hardware
"""

from lmstack.config.errors import LmstackError

# Exit codes of `lmstack train` (documented in the README's reliability section):
#   0 finished; 2 config/data error; 130 SIGINT; 143 SIGTERM (a checkpoint was saved first).
EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}


class TrainingStopped(LmstackError):
    """Training stopped on a signal after saving a checkpoint; `exit_code` is 128 + signal number."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class NonFiniteLoss(LmstackError):
    """The loss became NaN/Inf and `on_nonfinite` (or its skip budget) says to stop."""

    exit_code = 3
