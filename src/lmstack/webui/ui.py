"""What every tab shares: the field widgets generated from the schema, the translated words, and the
guard that turns an error into a message instead of a broken page."""

from __future__ import annotations

import functools
import logging
import traceback
from collections.abc import Callable
from typing import Any

import gradio as gr

from lmstack.config.errors import LmstackError
from lmstack.config.secrets import redact
from lmstack.webui import catalog
from lmstack.webui.actions import ChatModel
from lmstack.webui.fields import UNSET, FieldSpec, choice_key, field_specs, form_to_flat, to_widget
from lmstack.webui.i18n import field_help, t
from lmstack.webui.runs import RunRegistry

logger = logging.getLogger(__name__)


def error_text(err: BaseException) -> str:
    """An error for the page: lmstack's own errors as they are (they name the field and the fix)."""
    if isinstance(err, LmstackError):
        return redact(str(err))
    logger.error("web UI action failed:\n%s", traceback.format_exc())
    return redact(f"{type(err).__name__}: {err}")


def message(text: str, ok: bool = True) -> str:
    css = "lm-ok" if ok else "lm-error"
    body = text.replace("\n", "  \n")
    return f'<div class="{css}">\n\n{body}\n\n</div>'


class Ui:
    """The form (one widget per schema field), the run registry, the chat model and the language."""

    def __init__(
        self, share_dir: str, lang: str = "en", dataset_dir: str = "data", allow_dirs: list[str] | None = None
    ):
        from lmstack.webui.paths import roots

        self.allowed = roots(allow_dirs)  # where Load/Save YAML may read and write
        self.specs: list[FieldSpec] = field_specs()
        self.by_name = {s.name: s for s in self.specs}
        self.fields: dict[str, Any] = {}
        self.words: list[tuple[Any, str, str]] = []  # (component, property, string key) to translate
        self.registry = RunRegistry(share_dir)
        self.chat = ChatModel()
        self.lang = lang
        self.dataset_dir = dataset_dir
        self.keep: Any = None  # gr.State: the keys a loaded YAML set

    # ---- words -------------------------------------------------------------------------------------
    def word(self, component: Any, key: str, prop: str = "label") -> Any:
        self.words.append((component, prop, key))
        return component

    def relabel(self, lang: str) -> list[Any]:
        """Updates for `self.relabel_outputs()` in language `lang`."""
        updates = [gr.update(info=field_help(self.by_name[name], lang)) for name in self.fields]
        return updates + [gr.update(**{prop: t(key, lang)}) for _, prop, key in self.words]

    def relabel_outputs(self) -> list[Any]:
        return [*self.fields.values(), *(c for c, _, _ in self.words)]

    # ---- fields ------------------------------------------------------------------------------------
    def field(self, name: str, **layout: Any) -> Any:
        """The widget of one schema field (created once, where it is laid out)."""
        spec = self.by_name[name]
        common = dict(label=name, info=field_help(spec, self.lang), elem_id=f"f-{name}", **layout)
        value = to_widget(spec, spec.default)
        if spec.kind == "bool":
            widget = gr.Checkbox(value=value, **common)
        elif spec.kind == "choice":
            choices = [(UNSET if c is None else choice_key(c), choice_key(c)) for c in spec.choices]
            widget = gr.Dropdown(choices=choices, value=value, **common)
        elif spec.kind == "int" and not spec.nullable:
            widget = gr.Number(value=value, precision=0, **common)
        elif spec.kind == "datasets":
            choices, _ = catalog.list_datasets(self.dataset_dir)
            widget = gr.Dropdown(
                choices=choices, value=[], multiselect=True, allow_custom_value=True, **common
            )
        elif spec.kind == "template":
            choices = [(t("auto_template", self.lang), UNSET), *catalog.template_choices()]
            widget = gr.Dropdown(choices=choices, value=UNSET, **common)
        else:  # text, float, yaml, secret
            kind = "password" if spec.kind == "secret" else "text"
            widget = gr.Textbox(value=value, lines=1, max_lines=1, type=kind, **common)
        self.fields[name] = widget
        return widget

    def fields_grid(self, names: list[str], per_row: int = 4) -> None:
        for i in range(0, len(names), per_row):
            with gr.Row(equal_height=True):
                for name in names[i : i + per_row]:
                    self.field(name, min_width=220)

    def section_names(self, section: str, skip: set[str]) -> list[str]:
        return [s.name for s in self.specs if s.section == section and s.name not in skip]

    def inputs(self) -> list[Any]:
        """[keep state, every field widget in schema order]: what handlers taking the form receive."""
        return [self.keep, *(self.fields[s.name] for s in self.specs)]

    def field_outputs(self) -> list[Any]:
        return [self.fields[s.name] for s in self.specs]

    def flat(self, keep: list[str] | None, raw: tuple) -> dict[str, Any]:
        return form_to_flat(self.specs, list(raw), keep or [])


def guarded(n_outputs: int, error_at: int = 0) -> Callable:
    """Runs a handler; on an error every output is left as it was except output `error_at`, which
    gets the error message."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args: Any) -> Any:
            try:
                return fn(*args)
            except Exception as err:  # shown on the page; the server keeps running
                out = [gr.update() for _ in range(n_outputs)]
                out[error_at] = message(error_text(err), ok=False)
                return out[0] if n_outputs == 1 else tuple(out)

        return run

    return wrap
