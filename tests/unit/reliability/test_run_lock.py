"""One run per output_dir: a second `lmstack train` into a folder another run holds is refused
(exit 2, before the model loads) naming the holder's pid; the lock goes with the holder's process."""

from __future__ import annotations

import subprocess
import sys

import yaml

HOLD = (
    "import sys; from lmstack.reliability.run_lock import acquire; acquire(sys.argv[1]); "
    "print('locked', flush=True); sys.stdin.read()"
)


def _train(cfg: dict, tmp_path) -> subprocess.CompletedProcess:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "lmstack.cli", "train", str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_second_run_refused_while_first_holds_the_lock(base_cfg, tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"  # the event: the lock is held now
        done = _train(base_cfg, tmp_path)
        assert done.returncode == 2, done.stderr[-2000:]
        assert f"in use by another lmstack run (pid {holder.pid})" in done.stderr
        assert not out.exists() or not list(out.iterdir())  # nothing written into output_dir
    finally:
        holder.kill()
        holder.wait()
    # killed holder: the OS released its lock, and a new holder takes it
    again = subprocess.run([sys.executable, "-c", HOLD, str(out)], input="", capture_output=True, text=True)
    assert again.returncode == 0 and "locked" in again.stdout


def test_output_dir_that_is_a_file_is_refused(tmp_path):
    import pytest

    from lmstack.config.errors import ConfigError
    from lmstack.reliability.run_lock import acquire

    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        acquire(tmp_path / "f")


def test_a_web_ui_start_into_a_held_output_dir_fails_naming_the_holder(base_cfg, tmp_path):
    """A web-UI Start runs the same `lmstack train`, so it takes the same lock: a Start into a folder that
    another run holds (a CLI run, or a run of another web UI on another share dir) ends failed, exit 2,
    its log naming the holder's pid, and the Runs tab does not call it finished."""
    from lmstack.webui.runs import RunRegistry

    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    registry = RunRegistry(tmp_path / "share")
    try:
        assert holder.stdout.readline().strip() == "locked"
        registry.start({**base_cfg, "output_dir": str(out)})
        assert registry.wait(str(out), timeout=600) == 2  # the timeout only guards a hang
        assert registry.state(str(out)) == ("failed", 2)
        assert f"in use by another lmstack run (pid {holder.pid})" in registry.view(str(out)).log_tail
    finally:
        holder.kill()
        holder.wait()
