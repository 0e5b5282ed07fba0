"""run_manifest.json in output_dir: what ran (resolved config, secrets redacted), with which code
(package versions, lmstack git commit), on which data (file sha256; with `tokenized_path`, the key of
the saved tokenized data that was actually trained) and which hardware.

`run_identity(cfg, decisions)`: the resolved run (config with secrets redacted, the run plan's
decisions, the data files' sha256, the datasets' registry entries and the model folders' tokenizer,
config and weight identities: reliability/identity.py) and its hash; every checkpoint's manifest.json stores it, so a
resume can list what changed (see output_dir.py)."""

from __future__ import annotations

import hashlib
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
from lmstack.reliability.identity import data_sha256, model_inputs

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


def _dataset_files(cfg: Config) -> list[tuple[str, Any, Path, list[Path]]]:
    """(field, attr, root, files) of every dataset of `dataset` and `eval_dataset`: the files it reads
    (a hub entry: its local folder or hub-cache snapshot; none when not on disk before loading)."""
    from lmstack.data.loader import source_files
    from lmstack.data.registry import get_dataset_attrs

    out = []
    for names, field in ((cfg.data.dataset, "dataset"), (cfg.data.eval_dataset, "eval_dataset")):
        for attr in get_dataset_attrs(names, cfg.data.dataset_dir, field):
            root, paths = source_files(attr) or (Path(attr.source), [])
            out.append((field, attr, root, paths))
    return out


def data_files(cfg: Config) -> dict[str, dict[str, Any]]:
    files: dict[str, dict[str, Any]] = {}
    for _, attr, _, paths in _dataset_files(cfg):
        if attr.load_from != "file":
            files[attr.name] = {"hub": attr.source}
        for path in paths:
            files[str(path)] = {
                "dataset": attr.name,
                "size": path.stat().st_size,
                "sha256": data_sha256(path),
            }
    return files


def dataset_entries(cfg: Config) -> dict[str, Any]:
    """`<field>:<dataset> <key>` -> what dataset_info.json says about a dataset besides where it is:
    each `columns`/`tags` mapping, formatting, split... (a swapped `columns` trains other text from the
    same files)."""
    from dataclasses import asdict

    out: dict[str, Any] = {}
    for field, attr, _, _ in _dataset_files(cfg):
        for key, value in asdict(attr).items():
            if key in ("name", "source"):
                continue
            items = value.items() if isinstance(value, dict) else [(None, value)]
            for sub, item in items:
                out[f"dataset entry {field}:{attr.name} {key}{'.' + sub if sub else ''}"] = item
    return out


def data_digests(cfg: Config) -> dict[str, Any]:
    """`<field>:<dataset>/<file inside it>` -> sha256 (hub datasets: their repo, subset and split, and
    the files read). Keyed by dataset name, not by path: the same data moved to another dataset_dir
    is the same data."""
    out: dict[str, Any] = {}
    for field, attr, root, paths in _dataset_files(cfg):
        if attr.load_from != "file":
            known = "" if paths else " (content not on disk before loading: not compared)"
            out[f"{field}:{attr.name}"] = f"hub {attr.source} subset={attr.subset} split={attr.split}{known}"
        for path in paths:
            out[f"{field}:{attr.name}/{path.relative_to(root).as_posix()}"] = data_sha256(path)
    return out


def run_identity(cfg: Config, decisions: dict | None) -> dict[str, Any]:
    """{"run": {config, decisions, data}, "run_hash": sha256 of it}: what a checkpoint was trained
    with. JSON-normalised, so what is stored is exactly what a resume compares."""
    inputs = {**dataset_entries(cfg), **model_inputs(cfg)}
    run = {
        "config": cfg.flat(redact=True),
        "decisions": decisions,
        "data": data_digests(cfg),
        "inputs": inputs,
    }
    run = json.loads(json.dumps(run, sort_keys=True, default=str))
    return {"run": run, "run_hash": identity_hash(run)}


def identity_hash(run: dict) -> str:
    return hashlib.sha256(json.dumps(run, sort_keys=True, default=str).encode()).hexdigest()


def tokenized_data(cfg: Config) -> dict[str, Any] | None:
    """With tokenized_path: the folder and the key of the tokenized data there (what was trained)."""
    if not cfg.data.tokenized_path:
        return None
    from lmstack.data.saved import saved_key_of

    return {"path": cfg.data.tokenized_path, "key": saved_key_of(cfg.data.tokenized_path)}


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
        "tokenized_data": tokenized_data(cfg),  # tokenized_path: the saved data that was trained
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
