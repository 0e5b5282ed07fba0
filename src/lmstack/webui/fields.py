"""The form's single source of truth: every field of `config/schema.py SECTIONS` as a `FieldSpec`
(widget kind, choices, default, one-line help), and the two conversions between widget values and
the flat YAML values `lmstack train` reads. Nothing here imports gradio.

A YAML written from the form holds the fields a user set (those of a loaded file are kept as they
were, in the file's order) and every field that differs from its schema default, so a loaded
LLaMA-Factory or lmstack YAML saves back equal in meaning (`build_config` gives the same `Config`).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import SecretStr
from pydantic_core import PydanticUndefined

from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config
from lmstack.config.schema import SECTIONS, Config

UNSET = "(unset)"  # the dropdown entry for None
# Shown at the top of the Train tab, in this order; every other field sits in its section's accordion.
UP_FRONT = (
    "model_name_or_path",
    "template",
    "stage",
    "finetuning_type",
    "dataset_dir",
    "dataset",
    "output_dir",
    "learning_rate",
    "num_train_epochs",
    "max_steps",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "cutoff_len",
    "max_samples",
    "lr_scheduler_type",
    "warmup_ratio",
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "lora_target",
    "logging_steps",
    "save_steps",
    "val_size",
    "bf16",
)
# Fields with a widget of their own: dataset names picked from dataset_info.json, a registry template.
WIDGET_KINDS = {"dataset": "datasets", "eval_dataset": "datasets", "template": "template"}
# Sections shown on other tabs (Chat: generation settings; Export: export settings).
TAB_SECTIONS = {"generating": "chat", "export": "export"}
TAB_FIELDS = {"infer_dtype": "export"}  # a field of a Train section shown on another tab


@dataclass(frozen=True)
class FieldSpec:
    name: str
    section: str
    kind: str  # bool | choice | int | float | text | secret | yaml | datasets | template
    default: Any
    required: bool
    description: str
    choices: tuple = ()  # choice: the allowed values (None included when nullable)
    nullable: bool = False


def _literal_values(args: tuple) -> list:
    out: list = []
    for arg in args:
        if typing.get_origin(arg) is typing.Literal:
            out += list(typing.get_args(arg))
        elif arg is bool:
            out += [True, False]
        elif arg is type(None):
            out.append(None)
        else:
            return []  # a union with a free type (int | "auto") is not a closed set
    return out


def _kind(annotation: Any) -> tuple[str, tuple, bool]:
    """(kind, choices, nullable) of a field annotation."""
    if annotation is bool:
        return "bool", (), False
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation) if origin is not typing.Literal else (annotation,)
    args = args or (annotation,)
    nullable = type(None) in args
    values = _literal_values(args)
    if values and any(typing.get_origin(a) is typing.Literal for a in args) or (values and bool in args):
        return "choice", tuple(values), nullable
    rest = [a for a in args if a is not type(None)]
    if len(rest) == 1:
        plain = {int: "int", float: "float", str: "text", SecretStr: "secret"}.get(rest[0])
        if plain:
            return plain, (), nullable
    return "yaml", (), nullable


def field_specs() -> list[FieldSpec]:
    """Every schema field, in schema order."""
    specs = []
    for section, cls in SECTIONS.items():
        for name, info in cls.model_fields.items():
            kind, choices, nullable = _kind(info.annotation)
            kind = WIDGET_KINDS.get(name, kind)
            default = None if info.default is PydanticUndefined else info.default
            specs.append(
                FieldSpec(
                    name=name,
                    section=section,
                    kind=kind,
                    default=default,
                    required=info.is_required(),
                    description=info.description or "",
                    choices=choices,
                    nullable=nullable,
                )
            )
    return specs


def choice_key(value: Any) -> str:
    """The dropdown value standing for a choice (dropdowns hold strings)."""
    if value is None:
        return UNSET
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def to_widget(spec: FieldSpec, value: Any) -> Any:
    """A flat YAML value -> what the field's widget shows."""
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if spec.kind == "bool":
        return bool(value)
    if spec.kind == "choice":
        return choice_key(value)
    if spec.kind == "datasets":
        return [n.strip() for n in (value or "").split(",") if n.strip()]
    if spec.kind == "template":
        return value or UNSET
    if spec.kind == "int":  # a nullable int is a textbox (a number box cannot be empty)
        return ("" if value is None else str(value)) if spec.nullable else value
    if spec.kind == "float":  # a textbox: 5e-05 stays readable, as in a YAML file
        return "" if value is None else repr(float(value))
    if spec.kind == "yaml":
        if value is None:
            return ""
        if isinstance(value, str | int | float):
            return str(value)
        return yaml.safe_dump(value, default_flow_style=True).strip()
    return "" if value is None else str(value)


def to_value(spec: FieldSpec, raw: Any) -> Any:
    """A widget's value -> the flat YAML value (errors name the field)."""
    if spec.kind == "bool":
        return bool(raw)
    if spec.kind == "choice":
        by_key = {choice_key(c): c for c in spec.choices}
        if raw not in by_key:
            allowed = " | ".join(by_key)
            raise ConfigError(f"{spec.name}: got {raw!r}; allowed: {allowed}")
        return by_key[raw]
    if spec.kind in ("int", "float"):
        return _number(spec, raw)
    if spec.kind == "datasets":
        names = [n.strip() for n in (raw.split(",") if isinstance(raw, str) else raw or [])]
        return ",".join(n for n in names if n) or None
    if spec.kind == "template" and raw == UNSET:
        return None
    text = "" if raw is None else str(raw).strip()
    if text == "":
        return None if spec.nullable or spec.required else spec.default
    if spec.kind == "yaml":
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError(f"{spec.name}: {text!r} is not a YAML value: {err}") from None
    return text


def _number(spec: FieldSpec, raw: Any) -> int | float | None:
    if raw is None or (isinstance(raw, str) and raw.strip() == ""):
        if spec.nullable:
            return None
        raise ConfigError(f"{spec.name}: needs a number (default {spec.default!r})")
    try:
        number = float(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{spec.name}: got {raw!r}; expected a number") from None
    if spec.kind == "float":
        return number
    if not number.is_integer():
        raise ConfigError(f"{spec.name}: got {raw!r}; expected a whole number")
    return int(number)


def _same(default: Any, value: Any) -> bool:
    if isinstance(default, SecretStr):
        default = default.get_secret_value()
    return default == value and isinstance(default, bool) == isinstance(value, bool)


def form_to_flat(specs: list[FieldSpec], raw: list[Any], keep: list[str] | None = None) -> dict[str, Any]:
    """The widgets' values (in `specs` order) -> the flat YAML: the `keep` keys first (a loaded file's,
    in its order), then every required or non-default field in schema order."""
    values = {spec.name: to_value(spec, value) for spec, value in zip(specs, raw, strict=True)}
    by_name = {spec.name: spec for spec in specs}
    keys = [k for k in keep or [] if k in values]
    for spec in specs:
        if spec.name not in keys and (spec.required or not _same(spec.default, values[spec.name])):
            keys.append(spec.name)
    return {k: values[k] for k in keys if not (by_name[k].required and values[k] is None)}


def flat_to_form(specs: list[FieldSpec], flat: dict[str, Any]) -> tuple[list[Any], list[str]]:
    """A flat YAML (validated the way `lmstack train` validates it) -> (widget values in `specs` order,
    the keys it set). Unknown or unsupported fields are refused with `train`'s own error."""
    cfg = build_config(dict(flat))
    resolved = cfg.flat(redact=False)
    return [to_widget(spec, resolved[spec.name]) for spec in specs], list(flat)


def to_yaml(flat: dict[str, Any], previous: str | None = None) -> str:
    """The YAML of `flat`; given the text of the file it replaces, that file's comments, blank lines
    and key order are kept: each top-level key's lines are rewritten in place, removed keys dropped,
    new ones appended."""
    if not previous:
        return yaml.safe_dump(flat, sort_keys=False, allow_unicode=True)
    out: list[str] = []
    written: set[str] = set()
    skipping = False
    for line in previous.splitlines():
        key = _top_key(line)
        if key is None and skipping and (line[:1] in (" ", "\t", "-") and line.strip()):
            continue  # the rest of a rewritten key's block
        skipping = False
        if key is not None:
            skipping = True
            if key in flat and key not in written:
                out.append(yaml.safe_dump({key: flat[key]}, allow_unicode=True).rstrip("\n"))
                written.add(key)
            continue
        out.append(line)
    rest = {k: v for k, v in flat.items() if k not in written}
    text = "\n".join(out).rstrip("\n") + "\n"
    return text + (yaml.safe_dump(rest, sort_keys=False, allow_unicode=True) if rest else "")


def _top_key(line: str) -> str | None:
    """The key of a top-level `key: value` line (None for comments, blanks and nested lines)."""
    if not line or line[0] in " \t#-":
        return None
    key, sep, _ = line.partition(":")
    return key.strip().strip("'\"") if sep else None


def same_meaning(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two flat YAMLs drive the same run: their validated configs are equal."""
    return _config(a) == _config(b)


def _config(flat: dict[str, Any]) -> Config:
    return build_config(dict(flat))
