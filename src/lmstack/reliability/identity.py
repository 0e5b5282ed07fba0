"""Cheap content identities of the model folders a run starts from, for the run identity that every
checkpoint stores (manifest.run_identity): a resume refuses a base model or adapter whose weights were
replaced in place, or whose tokenizer was edited, although its path is the same.

- tokenizer and config files: sha256 of the whole file (they are small);
- weight files: size, sha256 of the safetensors header (names, dtypes, shapes, offsets) and sha256 of
  16 blocks of 64 KiB spread over the file. Retrained or replaced weights differ in every block, so
  this tells them apart while reading about 1 MiB a file, not the whole model; the mtime is left out
  (a copy or `touch` is the same model)."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Any

from lmstack.config.schema import Config
from lmstack.reliability.checkpoint import sha256_file

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
CONFIG_FILES = ("config.json", "adapter_config.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
SAMPLES, BLOCK = 16, 1 << 16


_SHA256: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> sha256, for data files


def data_sha256(path: Path) -> str:
    """sha256 of a data file, hashed once per process while its size and mtime stay the same (the run
    manifest, the resume check and every checkpoint's run identity all need it)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _SHA256:
        _SHA256[key] = sha256_file(path)
    return _SHA256[key]


def weights_identity(path: Path) -> str:
    size = path.stat().st_size
    sample = hashlib.sha256()
    header = ""
    with path.open("rb") as fh:
        if path.suffix == ".safetensors" and size >= 8:
            (length,) = struct.unpack("<Q", fh.read(8))
            if length <= min(size - 8, 100 << 20):
                header = hashlib.sha256(fh.read(length)).hexdigest()[:16]
        for i in range(SAMPLES):
            fh.seek(max(0, (size - BLOCK) * i // max(SAMPLES - 1, 1)))
            sample.update(fh.read(BLOCK))
    return f"size={size} header={header or '-'} sample={sample.hexdigest()[:16]}"


def folder_identity(folder: Path) -> dict[str, str]:
    """file name -> identity, for the tokenizer, config and weight files at the top of `folder`."""
    out = {}
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        if path.name in TOKENIZER_FILES or path.name in CONFIG_FILES:
            out[path.name] = data_sha256(path)
        elif path.suffix in WEIGHT_SUFFIXES:
            out[path.name] = weights_identity(path)
    return out


def model_inputs(cfg: Config) -> dict[str, Any]:
    """`<field> <file>` -> identity, for model_name_or_path and each adapter_name_or_path folder (a hub
    id that names no local folder is its name in the config)."""
    adapters = [a.strip() for a in (cfg.model.adapter_name_or_path or "").split(",") if a.strip()]
    fields = [("model_name_or_path", cfg.model.model_name_or_path)]
    fields += [(f"adapter_name_or_path[{i}]", a) for i, a in enumerate(adapters)]
    out: dict[str, Any] = {}
    for field, where in fields:
        folder = Path(where).expanduser()
        if folder.is_dir():
            out.update({f"{field} {name}": ident for name, ident in folder_identity(folder).items()})
    return out
