"""run_manifest.json in output_dir: what ran (resolved config, secrets redacted), with which code
(package versions, lmstack git commit), on which data (file sha256) and which hardware."""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from lmstack.config.schema import Config
from lmstack.config.secrets import redact
from lmstack.reliability.checkpoint import sha256_file

logger = logging.getLogger(__name__)
RUN_MANIFEST = "run_manifest.json"
PACKAGES = ("lmstack", "torch", "transformers", "peft", "trl", "accelerate", "datasets", "deepspeed")


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_commit() -> str | None:
    """The lmstack source checkout's commit (None when installed from a wheel or git is missing)."""
    src = Path(__file__).resolve().parents[1]
    try:
        done = subprocess.run(
            ["git", "-C", str(src), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and len(commit) == 40 else None


def hardware() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "cpu_count": os.cpu_count()}
    try:
        import torch

        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            info["cuda"] = torch.version.cuda
    except Exception as err:  # hardware probing must never stop a run
        info["gpu_probe_error"] = str(err)
    return info


def data_files(cfg: Config) -> dict[str, dict[str, Any]]:
    from lmstack.data.registry import get_dataset_attrs

    files: dict[str, dict[str, Any]] = {}
    for names, field in ((cfg.data.dataset, "dataset"), (cfg.data.eval_dataset, "eval_dataset")):
        for attr in get_dataset_attrs(names, cfg.data.dataset_dir, field):
            if attr.load_from != "file":
                files[attr.name] = {"hub": attr.source}
                continue
            root = Path(attr.source)
            paths = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
            for path in paths:
                files[str(path)] = {
                    "dataset": attr.name,
                    "size": path.stat().st_size,
                    "sha256": sha256_file(path),
                }
    return files


def build_run_manifest(
    cfg: Config, resumed_from: str | None = None, plan: dict | None = None
) -> dict[str, Any]:
    from lmstack.launch.context import topology

    world = plan["decisions"]["world_size"] if plan else topology().world_size
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": [redact(a) for a in sys.argv],
        "resumed_from": resumed_from,
        "config": cfg.flat(redact=True),
        "versions": versions(),
        "lmstack_git_commit": git_commit(),
        "data_files": data_files(cfg),
        "hardware": hardware(),
        "world_size": world,
        "plan": plan,  # RunPlan.to_dict(): every derived decision and its reason
    }


def write_run_manifest(cfg: Config, resumed_from: str | None = None, plan: dict | None = None) -> Path:
    """Written at train start (rank 0); a resumed run keeps the earlier starts under `previous`."""
    path = Path(cfg.training.output_dir) / RUN_MANIFEST
    manifest = build_run_manifest(cfg, resumed_from, plan)
    if resumed_from and path.is_file():
        try:
            old = json.loads(path.read_text())
            manifest["previous"] = [*old.pop("previous", []), old]
        except ValueError:
            logger.warning("%s was unreadable; starting a new one", path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(redact(json.dumps(manifest, indent=1, default=str)))
    os.replace(tmp, path)
    return path
