"""The quickstart's training prints no warning that lmstack's own code causes: every Python warning and
every transformers/peft/torch log warning raised during a real `lmstack train examples/quickstart.yaml`
(in a fresh process, so transformers' warning_once caches are empty) is traced to the first frame
outside the library that emitted it; none of those frames may be in src/lmstack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

DRIVER = r'''
import json, logging, os, sys, traceback, warnings

SITE = os.sep + "site-packages" + os.sep
LMSTACK = os.path.join(sys.argv[1], "src", "lmstack") + os.sep
found = []

def package(filename):
    return filename.split(SITE, 1)[1].split(os.sep, 1)[0] if SITE in filename else None

def culprit():
    """The first frame outside the emitting library (and outside logging/warnings/this driver)."""
    frames = [f for f in traceback.extract_stack()[:-2] if not f.filename.endswith(("logging/__init__.py",
              "warnings.py", "<string>"))]
    emitter = None
    for frame in reversed(frames):
        pkg = package(frame.filename)
        if emitter is None:
            emitter = pkg
            continue
        if pkg != emitter:
            return frame
    return None

def record(kind, message):
    frame = culprit()
    if frame is not None and frame.filename.startswith(LMSTACK):
        found.append({"kind": kind, "message": message[:300], "at": f"{frame.filename}:{frame.lineno}"})

def show(message, category, filename, lineno, file=None, line=None):
    if filename.startswith(LMSTACK):
        found.append({"kind": category.__name__, "message": str(message)[:300], "at": f"{filename}:{lineno}"})
    else:
        record(category.__name__, str(message))

warnings.showwarning = show
warnings.simplefilter("always")

class Catch(logging.Handler):
    def emit(self, rec):
        if rec.levelno >= logging.WARNING and not rec.name.startswith("lmstack"):
            record("log " + rec.name, rec.getMessage())

for name in ("transformers", "peft", "torch", "accelerate", "trl", "datasets"):
    logging.getLogger(name).addHandler(Catch())

from lmstack.cli.main import main
rc = main(["train", *sys.argv[3:]])
json.dump({"rc": rc, "found": found}, open(sys.argv[2], "w"))
'''


def test_quickstart_training_raises_no_warning_from_lmstack_code(tmp_path, tiny_model):
    report = tmp_path / "warnings.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    overrides = [
        f"model_name_or_path={tiny_model}",
        f"dataset_dir={REPO / 'data'}",
        f"output_dir={tmp_path / 'out'}",
        "max_steps=4",
        "save_steps=2",
        "disable_tqdm=true",
    ]
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            DRIVER,
            str(REPO),
            str(report),
            str(REPO / "examples" / "quickstart.yaml"),
            *overrides,
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(report.read_text())
    assert result["rc"] == 0
    assert result["found"] == [], json.dumps(result["found"], indent=1)
