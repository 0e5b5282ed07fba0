"""The Train tab: the usual fields up front, every other field of the schema under its section, and
Preview data / Plan / Preview YAML / Load / Save / Start."""

from __future__ import annotations

from typing import Any

import gradio as gr
import yaml

from lmstack.config import secrets
from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config
from lmstack.webui import actions, catalog
from lmstack.webui.fields import TAB_FIELDS, TAB_SECTIONS, UP_FRONT, flat_to_form, to_widget, to_yaml
from lmstack.webui.i18n import LANGS, t
from lmstack.webui.paths import confine
from lmstack.webui.ui import Ui, guarded, message

TRAIN_SECTIONS = ("model", "data", "finetuning", "training")


def build(ui: Ui) -> dict[str, Any]:
    """Lays the tab out; returns the widgets other tabs wire to."""
    w: dict[str, Any] = {}
    ui.fields_grid(list(UP_FRONT), per_row=4)
    skip = set(UP_FRONT) | set(TAB_FIELDS)
    for section in TRAIN_SECTIONS:
        if section in TAB_SECTIONS:
            continue
        with ui.word(
            gr.Accordion(t(f"sec_{section}", ui.lang), open=False, elem_id=f"sec-{section}"), f"sec_{section}"
        ):
            ui.fields_grid(ui.section_names(section, skip), per_row=3)
    with gr.Row():
        for key in ("preview_data", "preview_yaml"):
            w[key] = ui.word(
                gr.Button(t(f"btn_{key}", ui.lang), elem_id=f"btn-{key.replace('_', '-')}"),
                f"btn_{key}",
                "value",
            )
        w["start"] = ui.word(
            gr.Button(t("btn_start", ui.lang), variant="primary", elem_id="btn-start"), "btn_start", "value"
        )
    with gr.Row(equal_height=True):
        w["gpus"] = ui.word(
            gr.Number(value=1, precision=0, label=t("gpus", ui.lang), elem_id="plan-gpus"), "gpus"
        )
        w["gpu_mem"] = ui.word(
            gr.Number(value=80, label=t("gpu_memory", ui.lang), elem_id="plan-mem"), "gpu_memory"
        )
        with gr.Column():
            w["plan"] = ui.word(gr.Button(t("btn_plan", ui.lang), elem_id="btn-plan"), "btn_plan", "value")
            w["apply"] = ui.word(
                gr.Button(t("btn_apply", ui.lang), elem_id="btn-apply"), "btn_apply", "value"
            )
    with gr.Row(equal_height=True):
        w["yaml_path"] = ui.word(
            gr.Textbox(label=t("yaml_path", ui.lang), elem_id="yaml-path", scale=3), "yaml_path"
        )
        with gr.Column():
            w["load"] = ui.word(gr.Button(t("btn_load", ui.lang), elem_id="btn-load"), "btn_load", "value")
            w["save"] = ui.word(gr.Button(t("btn_save", ui.lang), elem_id="btn-save"), "btn_save", "value")
        w["upload"] = ui.word(
            gr.UploadButton(t("btn_upload", ui.lang), file_types=[".yaml", ".yml"], elem_id="btn-upload"),
            "btn_upload",
            "label",
        )
    w["msg"] = gr.Markdown(elem_id="train-msg")
    w["out"] = ui.word(
        gr.Textbox(
            label=t("output", ui.lang), lines=14, max_lines=40, elem_id="train-out", elem_classes=["lm-mono"]
        ),
        "output",
    )
    w["example"] = gr.HTML(elem_id="train-example")
    w["changes"] = gr.State({})
    return w


def wire(ui: Ui, w: dict[str, Any], lang: Any) -> None:
    form = ui.inputs()
    w["preview_yaml"].click(
        guarded(2)(lambda keep, *raw: ("", to_yaml(ui.flat(keep, raw)))), form, [w["msg"], w["out"]]
    )
    w["preview_data"].click(_preview_data(ui), form, [w["msg"], w["out"], w["example"]])
    w["plan"].click(_plan(ui), [w["gpus"], w["gpu_mem"], *form], [w["msg"], w["out"], w["changes"]])
    w["apply"].click(_apply(ui), [lang, w["changes"]], [w["msg"], *ui.field_outputs()])
    w["save"].click(_save(ui), [lang, w["yaml_path"], *form], [w["msg"], w["out"]])
    loaded = [w["msg"], ui.keep, *ui.field_outputs()]
    pickers = [ui.fields["dataset"], ui.fields["eval_dataset"]]
    w["load"].click(_load(ui), [lang, w["yaml_path"]], loaded).then(
        _choices, ui.fields["dataset_dir"], pickers
    )
    w["upload"].upload(_load(ui), [lang, w["upload"]], loaded).then(
        _choices, ui.fields["dataset_dir"], pickers
    )
    ui.fields["dataset_dir"].blur(_datasets, ui.fields["dataset_dir"], [*pickers, w["msg"]])


def _choices(dataset_dir: str) -> tuple:
    choices, _ = catalog.list_datasets(dataset_dir or "data")
    return gr.update(choices=choices), gr.update(choices=choices)


def _datasets(dataset_dir: str) -> tuple:
    choices, note = catalog.list_datasets(dataset_dir or "data")
    shown = message(note, ok=False) if note else ""
    return gr.update(choices=choices), gr.update(choices=choices), shown


def _preview_data(ui: Ui):
    @guarded(3)
    def run(keep: list[str], *raw: Any) -> tuple:
        text, example = actions.preview_data(ui.flat(keep, raw))
        return "", text, example

    return run


def _plan(ui: Ui):
    @guarded(3)
    def run(gpus: float, gpu_mem: float, keep: list[str], *raw: Any) -> tuple:
        table, changes = actions.plan_table(ui.flat(keep, raw), int(gpus or 1), float(gpu_mem or 80))
        return "", table, changes

    return run


def _apply(ui: Ui):
    outputs = len(ui.specs) + 1

    @guarded(outputs)
    def run(lang_label: str, changes: dict[str, Any]) -> tuple:
        lang = LANGS.get(lang_label, "en")
        if not changes:
            return (message(t("nothing_to_apply", lang), ok=False), *[gr.update()] * len(ui.specs))
        updates = [
            gr.update(value=to_widget(spec, changes[spec.name])) if spec.name in changes else gr.update()
            for spec in ui.specs
        ]
        shown = yaml.safe_dump(changes, default_flow_style=True, sort_keys=False).strip()
        return (message(t("applied", lang, changes=shown)), *updates)

    return run


def _save(ui: Ui):
    @guarded(2)
    def run(lang_label: str, path: str, keep: list[str], *raw: Any) -> tuple:
        lang = LANGS.get(lang_label, "en")
        if not (path or "").strip():
            return message(t("need_path", lang), ok=False), gr.update()
        flat = ui.flat(keep, raw)
        build_config(dict(flat))  # the file written is one `lmstack train` accepts
        target = confine(path, ui.allowed)
        text = to_yaml(flat, target.read_text(encoding="utf-8") if target.is_file() else None)
        target.parent.mkdir(parents=True, exist_ok=True)
        secrets.write_text(target, text, private=secrets.holds_secret(flat))
        return message(t("saved_yaml", lang, path=target)), text

    return run


def _load(ui: Ui):
    outputs = len(ui.specs) + 2

    @guarded(outputs)
    def run(lang_label: str, path: Any) -> tuple:
        lang = LANGS.get(lang_label, "en")
        path = getattr(path, "name", path)  # an upload hands over a file object (or its path)
        if not path or not str(path).strip():
            return (message(t("need_path", lang), ok=False), *[gr.update()] * (outputs - 1))
        source = confine(str(path), ui.allowed, uploads=True)
        try:
            data = actions.read_yaml(source)
        except Exception as err:  # the parser's message quotes the file's lines: name the file only
            mark = getattr(err, "problem_mark", None)
            where = f" (line {mark.line + 1})" if mark is not None else ""
            raise ConfigError(f"{path}: not a YAML mapping lmstack can read{where}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: not a YAML mapping lmstack can read")
        values, keep = flat_to_form(ui.specs, data)
        return (message(t("loaded_yaml", lang, path=path, n=len(keep))), keep, *values)

    return run
