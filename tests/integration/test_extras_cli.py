"""Optional dependencies are checked where the command starts, before any model loads: `lmstack api`
without the serve extra, `lmstack webui` without gradio (modules made unimportable with a
sitecustomize shim in a real subprocess); and `lmstack plan` of a hub id while offline says one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def lmstack(
    tmp_path: Path, *args: str, hide: tuple[str, ...] = (), **env: str
) -> subprocess.CompletedProcess:
    paths = [str(REPO / "src")]
    if hide:
        shim = tmp_path / "shim"
        shim.mkdir(exist_ok=True)
        (shim / "sitecustomize.py").write_text(
            f"import sys\nfor name in {list(hide)!r}:\n    sys.modules[name] = None\n"
        )
        paths.append(str(shim))
    full = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **env}
    full["PYTHONPATH"] = os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "lmstack.cli.main", *args], env=full, cwd=tmp_path, capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip


def test_api_without_the_serve_extra_is_refused_before_the_model_loads(tmp_path, tiny_model):
    cfg = tmp_path / "chat.yaml"
    cfg.write_text(yaml.safe_dump({"model_name_or_path": str(tiny_model), "template": "qwen"}))
    done = lmstack(tmp_path, "api", str(cfg), "--port", "0", hide=("uvicorn",))
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "error: lmstack api needs `uvicorn`, which is not installed; pip install 'lmstack[serve]'"
    )
    assert "Traceback" not in done.stderr and "loading" not in done.stderr.lower()


def test_webui_without_gradio_is_refused_naming_the_extra(tmp_path):
    done = lmstack(tmp_path, "webui", "--port", "0", hide=("gradio",))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "pip install 'lmstack[webui]'" in done.stderr and "Traceback" not in done.stderr


def test_plan_of_an_uncached_hub_id_offline_is_one_line(tmp_path):
    cfg = tmp_path / "plan.yaml"
    cfg.write_text(
        "model_name_or_path: lmstack-test/not-cached-anywhere\nstage: sft\nfinetuning_type: lora\n"
        f"dataset: alpaca_en_demo\ntemplate: qwen\noutput_dir: {tmp_path / 'out'}\n"
    )
    done = lmstack(tmp_path, "plan", str(cfg), HF_HOME=str(tmp_path / "hf"))
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        "error: model_name_or_path: lmstack-test/not-cached-anywhere is not in the local hub cache and "
        "HF_HUB_OFFLINE=1; download it first or give a local directory"
    ]
