"""The Chat tab (the trained model: base + adapter, streaming, system prompt, clear) and the Export
tab (merge into a plain model: export_dir, dtype, shard size)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gradio as gr

from lmstack.webui import actions
from lmstack.webui.fields import TAB_FIELDS, to_value
from lmstack.webui.i18n import LANGS, t
from lmstack.webui.ui import Ui, error_text, guarded, message


def build_chat(ui: Ui) -> dict[str, Any]:
    w: dict[str, Any] = {}
    w["hint"] = ui.word(gr.Markdown(t("chat_hint", ui.lang)), "chat_hint", "value")
    with gr.Row(equal_height=True):
        w["load"] = ui.word(
            gr.Button(t("btn_chat_load", ui.lang), variant="primary", elem_id="btn-chat-load"),
            "btn_chat_load",
            "value",
        )
        w["unload"] = ui.word(
            gr.Button(t("btn_chat_unload", ui.lang), elem_id="btn-chat-unload"), "btn_chat_unload", "value"
        )
    w["status"] = gr.Markdown(elem_id="chat-status")
    w["system"] = ui.word(gr.Textbox(label=t("system", ui.lang), lines=2, elem_id="chat-system"), "system")
    w["chatbot"] = ui.word(gr.Chatbot(label=t("chatbot", ui.lang), height=320, elem_id="chatbot"), "chatbot")
    with gr.Row(equal_height=True):
        w["message"] = ui.word(
            gr.Textbox(label=t("message", ui.lang), lines=1, scale=5, elem_id="chat-msg"), "message"
        )
        w["send"] = ui.word(
            gr.Button(t("btn_send", ui.lang), variant="primary", elem_id="btn-send"), "btn_send", "value"
        )
        w["clear"] = ui.word(gr.Button(t("btn_clear", ui.lang), elem_id="btn-clear"), "btn_clear", "value")
    with ui.word(
        gr.Accordion(t("sec_generating", ui.lang), open=True, elem_id="sec-generating"), "sec_generating"
    ):
        ui.fields_grid(ui.section_names("generating", set()), per_row=4)
    return w


def wire_chat(ui: Ui, w: dict[str, Any], lang: Any) -> None:
    w["load"].click(_load_model(ui), [lang, *ui.inputs()], w["status"])
    w["unload"].click(_unload(ui), [lang], w["status"])
    gen = [ui.fields[n] for n in ui.section_names("generating", set())]
    inputs = [lang, w["chatbot"], w["message"], w["system"], *gen]
    w["send"].click(_reply(ui), inputs, [w["chatbot"], w["message"], w["status"]])
    w["message"].submit(_reply(ui), inputs, [w["chatbot"], w["message"], w["status"]])
    w["clear"].click(lambda: ([], ""), None, [w["chatbot"], w["status"]])


def _load_model(ui: Ui):
    @guarded(1)
    def run(lang_label: str, keep: list[str], *raw: Any) -> str:
        lang = LANGS.get(lang_label, "en")
        ui.chat.load(ui.flat(keep, raw))
        return message(t("loaded_model", lang, source=ui.chat.source))

    return run


def _unload(ui: Ui):
    def run(lang_label: str) -> str:
        ui.chat.unload()
        return message(t("unloaded", LANGS.get(lang_label, "en")))

    return run


def _reply(ui: Ui):
    names = ui.section_names("generating", set())

    def run(lang_label: str, history: list, text: str, system: str, *gen: Any) -> Iterator[tuple]:
        lang = LANGS.get(lang_label, "en")
        if ui.chat.engine is None:
            yield history, text, message(t("no_model", lang), ok=False)
            return
        if not (text or "").strip():
            yield history, text, gr.update()
            return
        try:
            settings = {n: to_value(ui.by_name[n], v) for n, v in zip(names, gen, strict=True)}
            history = [*(history or []), {"role": "user", "content": text}]
            answer = {"role": "assistant", "content": ""}
            for piece in ui.chat.reply(history, system, settings):
                answer["content"] += piece
                yield [*history, answer], "", gr.update()
            yield [*history, answer], "", ""
        except Exception as err:  # shown under the chat; the turn is dropped
            yield history[:-1] if history else [], text, message(error_text(err), ok=False)

    return run


def build_export(ui: Ui) -> dict[str, Any]:
    w: dict[str, Any] = {}
    w["hint"] = ui.word(gr.Markdown(t("export_hint", ui.lang)), "export_hint", "value")
    names = ui.section_names("export", set()) + [n for n, tab in TAB_FIELDS.items() if tab == "export"]
    ui.fields_grid(names, per_row=3)
    w["export"] = ui.word(
        gr.Button(t("btn_export", ui.lang), variant="primary", elem_id="btn-export"), "btn_export", "value"
    )
    w["msg"] = gr.Markdown(elem_id="export-msg")
    w["out"] = ui.word(
        gr.Textbox(label=t("output", ui.lang), lines=8, elem_id="export-out", elem_classes=["lm-mono"]),
        "output",
    )
    return w


def wire_export(ui: Ui, w: dict[str, Any]) -> None:
    @guarded(2)
    def run(keep: list[str], *raw: Any) -> tuple:
        return "", actions.export_model(ui.flat(keep, raw))

    w["export"].click(run, ui.inputs(), [w["msg"], w["out"]])
