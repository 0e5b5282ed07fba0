"""YAML (+ key=value overrides) -> validated `Config`. Every error names the field and the fix."""

from __future__ import annotations

import logging
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from lmstack.config import secrets
from lmstack.config.errors import ConfigError, did_you_mean
from lmstack.config.schema import SECTIONS, Config, field_owner

logger = logging.getLogger(__name__)

# LLaMA-Factory fields lmstack knows by name but does not implement: a clear error instead of
# "unknown key" (DESIGN rule 6: unsupported -> error).
NOT_SUPPORTED = {
    "use_adam_mini",
    "use_llama_pro",
    "quantization_method",
    "use_kt",
    "use_mca",
    "mixture_of_depths",
    "shift_attn",
    "rope_scaling",
    "infer_backend",
    "vllm_maxlen",
    "export_quantization_bit",
    "export_quantization_dataset",
    "export_legacy_format",
    "export_hub_model_id",
    "use_swanlab",
    "ray_num_workers",
    "fp8",
    "enable_torch_profiler",
    "oft_rank",
    "predict_with_generate",
    "do_predict",
}


class _DupKeyLoader(yaml.SafeLoader):
    """SafeLoader that records repeated keys instead of silently keeping the last one."""


def _construct_mapping(loader: _DupKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    mapping: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        value = loader.construct_object(value_node, deep=deep)
        if key in mapping:
            line = key_node.start_mark.line + 1
            if mapping[key] != value:
                raise ConfigError(
                    f"{key}: set twice with different values ({mapping[key]!r}, then {value!r} at line {line}); "
                    "keep one"
                )
            loader.duplicates.append(f"{key} (line {line})")
        mapping[key] = value
    return mapping


_DupKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    loader = _DupKeyLoader(path.read_text(encoding="utf-8"))
    loader.duplicates = []
    try:
        data = loader.get_single_data() or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of field: value, got {type(data).__name__}")
    if loader.duplicates:
        logger.warning(
            "%s: repeated keys with the same value (kept once): %s", path, ", ".join(loader.duplicates)
        )
    return data


def parse_overrides(items: list[str]) -> dict:
    """`key=value` and `--key value` / `--key=value`; values are parsed as YAML scalars."""
    out: dict = {}
    i = 0
    while i < len(items):
        item = items[i]
        if item.startswith("--"):
            item = item[2:]
            if "=" not in item:
                if i + 1 >= len(items):
                    raise ConfigError(f"--{item}: missing value")
                item = f"{item}={items[i + 1]}"
                i += 1
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        out[key.strip()] = yaml.safe_load(raw) if raw != "" else None
        i += 1
    return out


def _annotation_parts(section: str, field: str) -> tuple[list, bool]:
    """(the Literal values a field allows, whether it also takes a bool)."""
    annotation = SECTIONS[section].model_fields[field].annotation
    literal = typing.get_origin(annotation) is typing.Literal
    args = (annotation,) if literal else (typing.get_args(annotation) or (annotation,))
    values = [v for arg in args if typing.get_origin(arg) is typing.Literal for v in typing.get_args(arg)]
    return values, bool in args


def _literal_choices(section: str, field: str) -> list[str] | None:
    annotation = SECTIONS[section].model_fields[field].annotation
    choices: list[str] = []
    for arg in typing.get_args(annotation) or (annotation,):
        if typing.get_origin(arg) is typing.Literal:
            choices += [str(a) for a in typing.get_args(arg)]
        elif arg is bool:
            choices += ["true", "false"]
    if typing.get_origin(annotation) is typing.Literal:
        choices = [str(a) for a in typing.get_args(annotation)]
    return choices or None


def _yaml_bools_to_words(section: str, values: dict[str, Any]) -> dict[str, Any]:
    """YAML 1.1 reads an unquoted `no`/`off` (`yes`/`on`) as a bool: `save_strategy: no` arrives as
    False. An enum field that allows one such word gets it back; fields that take a bool keep it."""
    out = dict(values)
    for field, value in values.items():
        if not isinstance(value, bool) or field not in SECTIONS[section].model_fields:
            continue
        choices, takes_bool = _annotation_parts(section, field)
        words = [c for c in choices if isinstance(c, str) and yaml.safe_load(c) is value]
        if not takes_bool and len(words) == 1:
            out[field] = words[0]
    return out


def _explain(section: str, err: ValidationError) -> ConfigError:
    lines = []
    for e in err.errors():
        field = str(e["loc"][0]) if e["loc"] else section
        if e["type"] == "missing":
            lines.append(f"{field}: required field is missing; add `{field}: ...` to the YAML")
            continue
        got = e.get("input")
        choices = _literal_choices(section, field) if field in SECTIONS[section].model_fields else None
        if e["type"].startswith("literal") or (choices and e["type"] in ("bool_parsing", "bool_type")):
            allowed = " | ".join(choices or [])
            hint = did_you_mean(str(got), choices or [])
            if isinstance(got, bool) and e["type"].startswith("literal"):
                hint += " (YAML reads an unquoted yes/no/on/off as a boolean; write one of these values)"
            lines.append(f"{field}: got {got!r}; allowed: {allowed}{hint}")
        else:
            lines.append(f"{field}: got {got!r}; {e['msg']}")
    return ConfigError("\n".join(lines))


def build_config(flat: dict[str, Any]) -> Config:
    secrets.register_flat(flat)  # token-like values are masked even in the errors below
    owners = field_owner()
    grouped: dict[str, dict] = {name: {} for name in SECTIONS}
    problems = []
    for key, value in flat.items():
        if key in owners:
            grouped[owners[key]][key] = value
        elif key in NOT_SUPPORTED:
            problems.append(f"{key}: a LLaMA-Factory field lmstack does not support yet; remove it")
        else:
            problems.append(
                f"{key}: unknown field{did_you_mean(key, owners)}; `lmstack train --help` lists them"
            )
    if problems:
        raise ConfigError("\n".join(problems))
    sections = {}
    for name, cls in SECTIONS.items():
        try:
            sections[name] = cls(**_yaml_bools_to_words(name, grouped[name]))
        except ValidationError as err:
            raise _explain(name, err) from None
    cfg = Config(**sections)
    secrets.register_config(cfg)
    return cfg


def load_config(path: str | Path | None, overrides: list[str] | dict | None = None) -> Config:
    flat = load_yaml(path) if path is not None else {}
    extra = overrides if isinstance(overrides, dict) else parse_overrides(list(overrides or []))
    flat.update(extra)
    return build_config(flat)


def save_config(cfg: Config, path: str | Path, plan_lines: str | None = None) -> None:
    """Resolved flat config (secrets redacted) — what `lmstack train` really ran with; the run plan
    (`plan_lines`) follows as YAML comments, so the file still loads as a config."""
    text = yaml.safe_dump(cfg.flat(redact=True), sort_keys=False, allow_unicode=True)
    if plan_lines:
        text += "".join(f"# {line}\n" for line in plan_lines.splitlines())
    Path(path).write_text(text)
