"""A folder lmstack writes (output_dir, export_dir) is never a folder the run reads: not
model_name_or_path, an adapter_name_or_path, ref_model, reward_model, dataset_dir or a dataset's file or
folder itself, nor inside one of them, nor around one (a full fine-tune into output_dir=M overwrote M;
an export into the adapter's folder mixes the merged model with the adapter)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from lmstack.config.errors import ConfigError, LmstackError
from lmstack.config.schema import Config


def read_paths(cfg: Config) -> list[tuple[str, str]]:
    """(field, local path) of everything the run reads (a hub id that names no local path is left out)."""
    from lmstack.data.registry import get_dataset_attrs

    m, ft, d = cfg.model, cfg.finetuning, cfg.data
    adapters = [a.strip() for a in (m.adapter_name_or_path or "").split(",") if a.strip()]
    items = [("model_name_or_path", m.model_name_or_path), *(("adapter_name_or_path", a) for a in adapters)]
    items += [
        (name, value)
        for name, value in (("ref_model", ft.ref_model), ("reward_model", ft.reward_model))
        if value
    ]
    items.append(("dataset_dir", d.dataset_dir))
    for names, field in ((d.dataset, "dataset"), (d.eval_dataset, "eval_dataset")):
        try:
            attrs = get_dataset_attrs(names, d.dataset_dir, field)
        except LmstackError:
            continue  # reported by the datasets check
        items += [(f"{field} {a.name} ({a.source})", a.source) for a in attrs]
    return [(name, path) for name, path in items if Path(path).expanduser().exists()]


def refuse_overlap(cfg: Config, field: str, given: str, why: str) -> None:
    """ConfigError naming every read path that `given` (the value of `field`) is, is inside or holds."""
    out = Path(given).expanduser().resolve()
    problems, data_dir_hit = [], False
    for name, path in read_paths(cfg):
        if name.startswith(("dataset ", "eval_dataset ")) and data_dir_hit:
            continue  # already said for dataset_dir
        p = Path(path).expanduser().resolve()
        if p == out:
            problems.append(f"{field}: {given} is {name} itself")
        elif p in out.parents:
            problems.append(f"{field}: {given} is inside {name} ({path})")
        elif out in p.parents:
            problems.append(f"{field}: {given} contains {name} ({path})")
        else:
            continue
        data_dir_hit = data_dir_hit or name == "dataset_dir"
    if problems:
        raise ConfigError(
            "; ".join(problems) + f". {why}, so it would overwrite or mix with them: choose an {field} "
            "outside every model, adapter and dataset folder"
        )


def check_writable(field: str, given: str) -> None:
    """`given` is a folder (or can become one) that this process can create files in: checked by
    creating one in it (or in its nearest existing parent), since permission bits do not tell a
    read-only mount. Nothing is left behind; the folder itself is not created here."""
    path = Path(given).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{field}: {given} is a file; give a folder (a new or an existing one)")
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{field}: {given} lies under {probe}, which is a file; give a folder path")
    try:
        fd, name = tempfile.mkstemp(prefix=".lmstack-write-check-", dir=probe)
        os.close(fd)
        os.unlink(name)
    except OSError as err:
        raise ConfigError(
            f"{field}: {given}: cannot create files in {probe} ({err.strerror}); choose a folder on a "
            "writable disk, or fix its permissions"
        ) from None


def check_output_dir(cfg: Config) -> None:
    """A run check (train/preflight.py, before anything loads; run_lock.py checks it is writable)."""
    given = cfg.training.output_dir
    out = Path(given).resolve()
    blocking = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise ConfigError(
            f"output_dir: {given} cannot be a folder: {blocking} is an existing file; "
            "give output_dir a folder path (new or existing)"
        )
    refuse_overlap(
        cfg,
        "output_dir",
        cfg.training.output_dir,
        "Training writes its weights, checkpoints and logs into output_dir (and overwrite_output_dir "
        "deletes there)",
    )
