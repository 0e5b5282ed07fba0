"""YAML (+ key=value overrides) -> validated `Config`. Every error names the field and the fix."""

from __future__ import annotations

import logging
import re
import typing
from collections import Counter
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from lmstack.config import secrets
from lmstack.config.errors import ConfigError, did_you_mean, short
from lmstack.config.lf_fields import LF_FIELDS, V1_KEYS, refusal
from lmstack.config.schema import SECTIONS, Config, field_owner, leaf_types

logger = logging.getLogger(__name__)

# bounds on a config document: a YAML file is a few KB; aliases may not expand it past this many nodes
# (a "billion laughs" document is a few hundred bytes that expands to 9**9 nodes)
MAX_YAML_CHARS = 1 << 20
MAX_YAML_NODES = 100_000


class _DupKeyLoader(yaml.SafeLoader):
    """SafeLoader that records repeated keys instead of silently keeping the last one."""


def _construct_mapping(loader: _DupKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    """`<<: *anchor` merges as in PyYAML's safe_load (and LF's OmegaConf): the mapping's own keys win
    over merged ones; only its own keys count as set twice."""
    own = {id(k) for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge"}
    loader.flatten_mapping(node)
    mapping: dict = {}
    merged = [(k, v) for k, v in node.value if id(k) not in own]
    for key_node, value_node in [(k, v) for k, v in node.value if id(k) in own]:
        key = loader.construct_object(key_node, deep=deep)
        value = loader.construct_object(value_node, deep=deep)
        if not isinstance(key, str | int | float | bool | type(None)):
            line = key_node.start_mark.line + 1
            raise ConfigError(f"line {line}: a key must be a plain name, got {short(key)}")
        if key in mapping:
            line = key_node.start_mark.line + 1
            if mapping[key] != value:
                raise ConfigError(
                    f"{key}: set twice with different values ({short(mapping[key])}, then {short(value)} "
                    f"at line {line}); keep one"
                )
            loader.duplicates.append(f"{key} (line {line})")
        mapping[key] = value
    for key_node, value_node in merged:
        mapping.setdefault(
            loader.construct_object(key_node, deep=deep), loader.construct_object(value_node, deep=deep)
        )
    return mapping


_DupKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
# `1e-4` is a number, as in LF (OmegaConf) and YAML 1.2; PyYAML's YAML 1.1 rules need `1.0e-4`
_DupKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _expanded_size(root: yaml.Node, where: str) -> int:
    """Nodes the document has once every alias is expanded (shared nodes counted at each use), without
    expanding anything; a recursive alias or more than MAX_YAML_NODES is refused."""
    size: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, leaving = stack.pop()
        if leaving:
            open_nodes.discard(id(node))
            size[id(node)] = min(1 + sum(size[id(c)] for c in _children(node)), MAX_YAML_NODES + 1)
            continue
        if id(node) in size:
            continue
        if id(node) in open_nodes:
            raise ConfigError(f"{where}: a YAML alias refers to a node that contains it; write the value out")
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in size)
    total = size[id(root)]
    if total > MAX_YAML_NODES:
        raise ConfigError(
            f"{where}: YAML aliases expand this document past {MAX_YAML_NODES} values (an alias bomb?); "
            "write the config without nested anchors"
        )
    return total


def _safe_load(text: str, where: str) -> tuple[Any, list[str]]:
    """YAML -> Python with SafeLoader semantics, repeated keys recorded, size and aliases bounded."""
    if len(text) > MAX_YAML_CHARS:
        raise ConfigError(
            f"{where}: {len(text)} characters; a config is at most {MAX_YAML_CHARS} (is this the right file?)"
        )
    loader = _DupKeyLoader(text)
    loader.duplicates = []
    try:
        node = loader.get_single_node()
        if node is None:
            return None, []
        _expanded_size(node, where)
        return loader.construct_document(node), loader.duplicates
    except yaml.YAMLError as err:
        raise ConfigError(f"{where}: not valid YAML: {err}") from None
    except RecursionError:
        raise ConfigError(f"{where}: values nested too deeply; a config is a flat mapping") from None
    finally:
        loader.dispose()


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path.stat().st_size > 4 * MAX_YAML_CHARS:  # refuse before reading a huge file
        raise ConfigError(f"{path}: {path.stat().st_size} bytes; a config is at most {MAX_YAML_CHARS}")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}: line {line}: byte {raw[err.start]:#04x} is not UTF-8; a config file is UTF-8 text: "
            "re-save it as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)"
        ) from None
    data, duplicates = _safe_load(text, str(path))
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of field: value, got {type(data).__name__}")
    if duplicates:
        logger.warning("%s: repeated keys with the same value (kept once): %s", path, ", ".join(duplicates))
    return data


def _takes_bool(key: str) -> bool:
    """Whether a bare `--key` (no value) means true: fields that take a bool, LF's boolean fields, and
    names lmstack does not know (build_config reports those)."""
    owner = field_owner().get(key)
    if owner is None:
        entry = LF_FIELDS.get(key)
        return entry is None or isinstance(entry.lf_default, bool)
    return _annotation_parts(owner, key)[1]


def parse_overrides(items: list[str]) -> dict:
    """LF's command-line forms: `key=value`, `--key value`, `--key=value` and a bare `--flag` (true, for
    boolean fields). Values are parsed as YAML scalars (`1e-4`, `true`, `q_proj,v_proj`, `{a: 1}`)."""
    out: dict = {}
    i = 0
    while i < len(items):
        item = items[i]
        if item.startswith("--"):
            item = item[2:]
            if "=" not in item:
                following = items[i + 1] if i + 1 < len(items) else None
                takes_value = following is not None and not following.startswith("--")
                if _takes_bool(item) and (not takes_value or "=" in following):
                    out[item.strip()] = True  # `--do_train --bf16`: bare booleans
                    i += 1
                    continue
                if not takes_value:
                    raise ConfigError(f"--{item}: missing value; write --{item} <value> or {item}=<value>")
                item = f"{item}={following}"
                i += 1
        if "=" not in item:
            raise ConfigError(f"override {short(item)}: expected key=value, --key value or --flag")
        key, raw = item.split("=", 1)
        out[key.strip()] = _value(key.strip(), raw)
        i += 1
    return out


def _value(key: str, raw: str) -> Any:
    """A command-line value, read as YAML; a text field keeps the text as written where YAML would
    make it a number, a mapping or an error (`--model_revision 2024`, `--default_system "Note: be brief"`)."""
    if raw == "":
        return None
    owner = field_owner().get(key)
    leaves = set(leaf_types(SECTIONS[owner].model_fields[key].annotation)) if owner else set()
    text_field = str in leaves and leaves <= {str, type(None)}
    try:
        value = _safe_load(raw, f"{key}=")[0]
    except ConfigError:
        if text_field:
            return raw
        raise
    if text_field and value is not None and not isinstance(value, str | list):
        return raw
    return value


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


_BOUNDS = (("gt", "greater than"), ("ge", "at least"), ("lt", "less than"), ("le", "at most"))
_KINDS = {int: "an integer", float: "a number", str: "a text"}


def _form(arg: Any) -> list[str]:
    """The values one member of a field's type allows, in words (`an integer greater than 0`, `auto`)."""
    if typing.get_origin(arg) is typing.Literal:
        return [str(v) for v in typing.get_args(arg)]
    if arg is bool:
        return ["true", "false"]
    if arg is type(None):
        return []
    meta: list = []
    if typing.get_origin(arg) is typing.Annotated:
        arg, *extra = typing.get_args(arg)
        meta = [m for item in extra for m in getattr(item, "metadata", [item])]
    bounds = [f"{word} {getattr(m, key)}" for m in meta for key, word in _BOUNDS if hasattr(m, key)]
    kind = _KINDS.get(arg, getattr(arg, "__name__", str(arg)))
    return [" ".join([kind, *bounds])]


def _union_line(section: str, field: str, got: Any) -> str:
    """One line for a value no member of a union accepts: pydantic's own text has one error per member
    (`Input should be greater than 0` and `Input should be 'auto'`), each wrong on its own."""
    annotation = SECTIONS[section].model_fields[field].annotation
    forms = [f for arg in typing.get_args(annotation) or (annotation,) for f in _form(arg)]
    return f"{field}: got {short(got)}; allowed: {' | '.join(forms)}"


def _explain(section: str, err: ValidationError) -> list[str]:
    lines: list[str] = []
    errors = err.errors()
    members = Counter(str(e["loc"][0]) for e in errors if len(e["loc"]) > 1)  # union members per field
    said: set[str] = set()
    for e in errors:
        msg = e["msg"].removeprefix("Value error, ")
        if not e["loc"]:  # a rule across fields: the message names them
            lines.append(msg)
            continue
        field = str(e["loc"][0])
        if members[field] > 1 and field in SECTIONS[section].model_fields:
            if field not in said:
                said.add(field)
                lines.append(_union_line(section, field, e.get("input")))
            continue
        if e["type"] == "missing":
            lines.append(f"{field}: required field is missing; add `{field}: ...` to the YAML")
            continue
        got = e.get("input")
        if secrets.SECRET_NAME.search(field):  # a secret is never echoed, whatever its type
            lines.append(f"{field}: got a value of type {type(got).__name__} (not shown: a secret); {msg}")
            continue
        choices = _literal_choices(section, field) if field in SECTIONS[section].model_fields else None
        if e["type"].startswith("literal") or (choices and e["type"] in ("bool_parsing", "bool_type")):
            allowed = " | ".join(choices or [])
            hint = did_you_mean(str(got), choices or [])
            if isinstance(got, bool) and e["type"].startswith("literal"):
                hint += " (YAML reads an unquoted yes/no/on/off as a boolean; write one of these values)"
            lines.append(f"{field}: got {short(got)}; allowed: {allowed}{hint}")
        else:
            lines.append(f"{field}: got {short(got)}; {msg}")
    return lines


def _v1_problem(flat: dict[str, Any], owners: dict[str, str]) -> str | None:
    """LF's v1 config (examples/v1/: `model:`, `peft_config:`, `dist_config:` ...) or any nested
    section: lmstack reads LF's flat v0 YAML."""
    v1 = [k for k in flat if k in V1_KEYS]
    nested = [k for k, v in flat.items() if k not in owners and k not in LF_FIELDS and isinstance(v, dict)]
    found = list(dict.fromkeys(v1 + nested))
    if not found:
        return None
    keys = ", ".join(f"`{k}:`" for k in found[:6]) + (" ..." if len(found) > 6 else "")
    return (
        f"{keys}: this looks like LLaMA-Factory's v1 config (nested `model:` / `peft_config:` / "
        "`dist_config:` blocks); lmstack reads LF's flat v0 YAML, the field names of LF's docs and "
        "examples/ (model_name_or_path, finetuning_type, lora_rank, per_device_train_batch_size, ...): "
        "write one `field: value` per line"
    )


def _key_problems(flat: dict[str, Any], owners: dict[str, str]) -> list[str]:
    """Names lmstack does not define: LF's own (accepted at their default or refused as not
    available) and unknown ones (with a suggestion from both sets)."""
    problems = []
    for key, value in flat.items():
        if key in owners:
            continue
        if key in LF_FIELDS:
            message = refusal(key, value)
            if message:
                problems.append(message)
            continue
        name = key if isinstance(key, str) and len(key) <= 100 else short(key, 100)
        known = [*owners, *LF_FIELDS]
        problems.append(
            f"{name}: unknown field{did_you_mean(str(key), known)}; `lmstack train --help` lists them"
        )
    return problems


def build_config(flat: dict[str, Any]) -> Config:
    """A flat mapping of LF field names -> Config; every problem is reported at once."""
    secrets.register_flat(flat)  # token-like values are masked even in the errors below
    owners = field_owner()
    v1 = _v1_problem(flat, owners)
    if v1:
        raise ConfigError(v1)
    problems = _key_problems(flat, owners)
    grouped: dict[str, dict] = {name: {} for name in SECTIONS}
    for key, value in flat.items():
        if key in owners:
            grouped[owners[key]][key] = value
    sections = {}
    for name, cls in SECTIONS.items():
        try:
            sections[name] = cls(**_yaml_bools_to_words(name, grouped[name]))
        except ValidationError as err:
            problems += _explain(name, err)
    if problems:
        raise ConfigError("\n".join(problems))
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
    Path(path).write_text(secrets.redact(text))  # token-like text in any field, as the manifest masks it
