"""`lmstack export`: base + adapters (merged in order) -> one plain transformers model directory.

export_dir gets: `model*.safetensors` (sharded by `export_size` GB, + index when sharded),
`config.json`, `generation_config.json` (eos = the template's stop tokens), the tokenizer with a
chat template that renders the training template (`chat_template.jinja`), an Ollama `Modelfile`, and
`value_head.safetensors` for reward models. Full/freeze runs re-export the same way (no adapters).

The export is written whole into a staging folder beside export_dir and swapped in at once
(reliability/atomic_dir.py), with a manifest.json (`kind: export`): a re-export never leaves an
earlier export's weights behind (a one-file model.safetensors beside new shards is what transformers
would load), and a kill leaves the previous export or the new one, never a mix.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any

from lmstack.config.errors import ConfigError
from lmstack.config.schema import Config
from lmstack.infer.engine import (
    adapter_dirs,
    check_inference,
    load_for_inference,
    load_infer_config,
    stop_token_ids,
)
from lmstack.models.adapter_save import follow_umask

logger = logging.getLogger(__name__)
VALUE_HEAD_FILES = ("value_head.safetensors", "value_head.bin")
EXPORT_KIND = "export"
# What an export (this one, an older lmstack's, transformers' save_pretrained) writes: an earlier
# export without a manifest loses these on a re-export; any other file in export_dir is kept.
_EXPORT_OUTPUT = re.compile(
    r"^(model[-.].*safetensors(\.index\.json)?|pytorch_model.*\.bin(\.index\.json)?|config\.json|"
    r"generation_config\.json|tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\.(json|txt)|"
    r"merges\.txt|chat_template\.(jinja|json)|Modelfile|value_head\.(safetensors|bin)|"
    r"(video_)?(pre)?processor_config\.json)$"
)


def is_export_output(name: str) -> bool:
    return bool(_EXPORT_OUTPUT.match(name))


def check_export(cfg: Config) -> Path:
    """Everything checkable before the model loads; returns the export dir."""
    if not cfg.export.export_dir:
        raise ConfigError(
            "export_dir: required for lmstack export; set export_dir: <folder for the merged model>"
        )
    out = Path(cfg.export.export_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"export_dir: {out} is a file; give a folder")
    sources = [cfg.model.model_name_or_path, *adapter_dirs(cfg)]
    if any(Path(s).exists() and Path(s).resolve() == out.resolve() for s in sources):
        raise ConfigError(f"export_dir: {out} is the model or adapter being exported; choose another folder")
    from lmstack.reliability.path_guards import check_writable, refuse_overlap

    check_writable("export_dir", str(out))
    refuse_overlap(cfg, "export_dir", str(out), "The export replaces the model files in export_dir")
    if out.is_dir() and any(out.iterdir()) and not cfg.export.export_overwrite:
        raise ConfigError(
            f"export_dir: {out} is not empty; set export_overwrite: true to write into it, "
            "or choose an empty folder"
        )
    check_inference(cfg)
    return out


def _value_head(cfg: Config) -> Path | None:
    """A reward model's value head beside the last adapter (LoRA) or in the model dir (full/freeze)."""
    adapters = adapter_dirs(cfg)
    where = Path(adapters[-1]) if adapters else Path(cfg.model.model_name_or_path)
    return next((where / n for n in VALUE_HEAD_FILES if (where / n).is_file()), None)


def write_export(cfg: Config, model: Any, tokenizer: Any, template: Any, out: Path) -> None:
    from lmstack.templates import Template
    from lmstack.templates.export_formats import ollama_modelfile, to_jinja

    out.mkdir(parents=True, exist_ok=True)
    stops = stop_token_ids(model, tokenizer, template)
    model.generation_config.eos_token_id = stops[0] if len(stops) == 1 else stops
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, max_shard_size=int(cfg.export.export_size * 10**9))
    follow_umask(out)  # safetensors writes its files 0600; the umask decides, as for every other file
    if isinstance(template, Template):
        tokenizer.chat_template = to_jinja(template)
        (out / "Modelfile").write_text(ollama_modelfile(template, tokenizer, stops), encoding="utf-8")
    else:
        (out / "Modelfile").unlink(missing_ok=True)
        logger.warning(
            "template unset: the tokenizer's own chat template is exported and no Ollama Modelfile is "
            "written; set template: <name> (the one used for training) to get both"
        )
    tokenizer.save_pretrained(out)
    from lmstack.models.vision import save_processor_files

    save_processor_files(cfg.model.model_name_or_path, str(out))  # a vision model loads with its processor
    head = _value_head(cfg)
    for name in VALUE_HEAD_FILES:
        (out / name).unlink(missing_ok=True)
    if head is not None:
        shutil.copy2(head, out / head.name)
        logger.info("copied the reward model's value head %s", head)


def export(config_path: str | Path | None, overrides: list[str] | dict | None = None) -> Path:
    import torch

    cfg = load_infer_config(config_path, overrides)
    out = check_export(cfg)
    device = "cuda" if cfg.export.export_device == "auto" and torch.cuda.is_available() else "cpu"
    model, tokenizer, template = load_for_inference(cfg, device)
    from lmstack.reliability import atomic_dir

    staged = atomic_dir.begin(out)
    write_export(cfg, model, tokenizer, template, staged)
    atomic_dir.commit(staged, out, {"kind": EXPORT_KIND}, is_export_output)
    shards = sorted(p.name for p in out.glob("model*.safetensors"))
    logger.info(
        "exported %s%s to %s (%s, %d shard%s)",
        cfg.model.model_name_or_path,
        f" + {', '.join(adapter_dirs(cfg))}" if adapter_dirs(cfg) else "",
        out,
        str(model.dtype).replace("torch.", ""),
        len(shards),
        "" if len(shards) == 1 else "s",
    )
    return out
