"""English and Chinese words of the web UI (data in `locales/`; read once, when first asked)."""

from __future__ import annotations

import functools
from pathlib import Path

import yaml

from lmstack.webui.fields import FieldSpec, choice_key

LANGS = {"English": "en", "中文": "zh"}
LOCALES = Path(__file__).parent / "locales"


@functools.cache
def _strings() -> dict[str, dict[str, str]]:
    return yaml.safe_load((LOCALES / "strings.yaml").read_text(encoding="utf-8"))


@functools.cache
def _fields_zh() -> dict[str, str]:
    path = LOCALES / "fields_zh.yaml"
    return yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else {}


def t(key: str, lang: str = "en", **values: object) -> str:
    entry = _strings()[key]
    text = entry.get(lang) or entry["en"]
    return text.format(**values) if values else text


def field_help(spec: FieldSpec, lang: str = "en") -> str:
    """The one-line help under a field: the schema's description (Chinese where translated), with
    the default."""
    text = (_fields_zh().get(spec.name) if lang == "zh" else None) or spec.description
    if spec.required:
        return text
    default = "null" if spec.default is None else choice_key(spec.default)
    return f"{text} ({'默认' if lang == 'zh' else 'default'} {default})"
