"""`lmstack webui`: the Gradio app (Train, Runs, Chat, Export) and its launch."""

from __future__ import annotations

import logging
from typing import Any

import gradio as gr

from lmstack.webui import chat_tab, runs_tab, train_tab
from lmstack.webui.i18n import LANGS, t
from lmstack.webui.ui import Ui

logger = logging.getLogger(__name__)

CSS = """
.lm-mono textarea { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 12px;
  white-space: pre; overflow-x: auto; }
.lm-example { white-space: pre-wrap; font-size: 12px; border: 1px solid #ddd; padding: 8px; border-radius: 6px; }
.lm-trained { background: #c9f2c7; color: #0b5e0b; font-weight: 600; }
.lm-masked { color: #8a8a8a; }
.lm-error { color: #b42318; }
.lm-ok { color: #1a5e1a; }
.lm-run progress { width: 100%; height: 14px; }
.lm-state-running { color: #1d4ed8; } .lm-state-finished { color: #15803d; }
.lm-state-stopped { color: #b45309; } .lm-state-failed, .lm-state-lost { color: #b42318; }
"""


def build_app(share_dir: str, lang: str = "en", allow_dirs: list[str] | None = None) -> gr.Blocks:
    ui = Ui(share_dir, lang, allow_dirs=allow_dirs)
    with gr.Blocks(title="lmstack", analytics_enabled=False) as demo:
        with gr.Row(equal_height=True):
            ui.word(gr.Markdown(t("title", lang)), "title", "value")
            names = {v: k for k, v in LANGS.items()}
            lang_radio = ui.word(
                gr.Radio(
                    list(LANGS),
                    value=names[lang],
                    label=t("lang", lang),
                    elem_id="lang",
                    scale=0,
                    min_width=240,
                ),
                "lang",
            )
        ui.word(gr.Markdown(t("subtitle", lang)), "subtitle", "value")
        ui.keep = gr.State([])
        with gr.Tabs(elem_id="tabs") as tabs:
            with ui.word(gr.Tab(t("tab_train", lang), id="train", elem_id="tab-train"), "tab_train"):
                train = train_tab.build(ui)
            with ui.word(gr.Tab(t("tab_runs", lang), id="runs", elem_id="tab-runs"), "tab_runs"):
                runs = runs_tab.build(ui)
            with ui.word(gr.Tab(t("tab_chat", lang), id="chat", elem_id="tab-chat"), "tab_chat"):
                chat = chat_tab.build_chat(ui)
            with ui.word(gr.Tab(t("tab_export", lang), id="export", elem_id="tab-export"), "tab_export"):
                export = chat_tab.build_export(ui)
        train_tab.wire(ui, train, lang_radio)
        runs_tab.wire(ui, runs, lang_radio, demo)
        chat_tab.wire_chat(ui, chat, lang_radio)
        chat_tab.wire_export(ui, export)
        _wire_start(ui, train, runs, tabs, lang_radio)
        lang_radio.change(
            lambda label: ui.relabel(LANGS.get(label, "en")),
            lang_radio,
            ui.relabel_outputs(),
            show_progress="hidden",
        )
    return demo


def _wire_start(ui: Ui, train: dict[str, Any], runs: dict[str, Any], tabs: Any, lang: Any) -> None:
    """Start: validate the form as `lmstack train` would, start the run, show it on the Runs tab."""
    from lmstack.config.load import build_config
    from lmstack.webui.ui import guarded, message

    @guarded(3)
    def start(lang_label: str, keep: list[str], *raw: Any) -> tuple:
        code = LANGS.get(lang_label, "en")
        flat = ui.flat(keep, raw)
        build_config(dict(flat))
        ui.registry.start(flat)
        out = str(flat["output_dir"])
        shown = message(t("started", code, out=out))
        return shown, runs_tab.run_choices(ui, select=out), gr.Tabs(selected="runs")

    train["start"].click(start, [lang, *ui.inputs()], [train["msg"], runs["run"], tabs])


def launch(
    host: str,
    port: int,
    auth: list[tuple[str, str]] | None,
    share_dir: str,
    lang: str = "en",
    block: bool = True,
    allow_dirs: list[str] | None = None,
    allow_hosts: list[str] | None = None,
) -> gr.Blocks:
    """Builds and serves the app (blocks until interrupted unless `block` is false); requests whose
    Host / Origin name another site, and login guessing, are refused (`webui/access.py`)."""
    from lmstack.webui.access import middleware

    demo = build_app(share_dir, lang, allow_dirs)
    demo.queue(default_concurrency_limit=4)
    demo.launch(
        server_name=host,
        server_port=port,
        auth=auth or None,
        share=False,
        inbrowser=False,
        prevent_thread_lock=True,
        show_error=True,
        quiet=True,
        ssr_mode=False,
        mcp_server=False,
        pwa=False,
        footer_links=[],
        css=CSS,
        app_kwargs={"middleware": middleware(host, tuple(allow_hosts or ()))},
    )
    login = f", login required ({len(auth)} user{'s' if len(auth) > 1 else ''})" if auth else ""
    print(
        f"lmstack webui on {demo.local_url} (runs tracked in {share_dir}{login}); Ctrl-C stops the UI, not its runs"
    )
    if block:
        demo.block_thread()
    return demo
