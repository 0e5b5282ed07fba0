"""The Runs tab: every run on the share dir (they outlive the page), live progress, the loss curve from
trainer_log.jsonl, the log tail, Stop (SIGTERM: a checkpoint is saved, exit code 143) and Resume."""

from __future__ import annotations

import html
from typing import Any

import gradio as gr
import pandas as pd

from lmstack.webui.actions import read_yaml
from lmstack.webui.i18n import LANGS, t
from lmstack.webui.runs import CONFIG_NAME, RunView
from lmstack.webui.train_tab import _load
from lmstack.webui.ui import Ui, guarded, message

REFRESH_SECONDS = 1.0
SERIES_COLORS = {"train": "#2563eb", "eval": "#dc2626"}


def build(ui: Ui) -> dict[str, Any]:
    w: dict[str, Any] = {}
    with gr.Row(equal_height=True):
        w["run"] = ui.word(
            gr.Dropdown(label=t("run", ui.lang), choices=[], allow_custom_value=True, elem_id="run", scale=4),
            "run",
        )
        w["refresh"] = ui.word(
            gr.Button(t("btn_refresh", ui.lang), elem_id="btn-refresh"), "btn_refresh", "value"
        )
        w["stop"] = ui.word(
            gr.Button(t("btn_stop", ui.lang), variant="stop", elem_id="btn-stop"), "btn_stop", "value"
        )
        w["resume"] = ui.word(
            gr.Button(t("btn_resume", ui.lang), elem_id="btn-resume"), "btn_resume", "value"
        )
        w["to_form"] = ui.word(
            gr.Button(t("btn_to_form", ui.lang), elem_id="btn-to-form"), "btn_to_form", "value"
        )
    w["msg"] = gr.Markdown(elem_id="runs-msg")
    w["status"] = gr.HTML(elem_id="run-status")
    w["plot"] = ui.word(
        gr.LinePlot(
            value=None, x="step", y="loss", color="series", color_map=SERIES_COLORS, label=t("loss_plot", ui.lang),
            elem_id="loss-plot", height=340,
        ),
        "loss_plot",
    )  # fmt: skip
    w["log"] = ui.word(
        gr.Textbox(
            label=t("log_tail", ui.lang), lines=12, max_lines=12, elem_id="run-log", elem_classes=["lm-mono"]
        ),
        "log_tail",
    )
    w["timer"] = gr.Timer(REFRESH_SECONDS)
    return w


def wire(ui: Ui, w: dict[str, Any], lang: Any, demo: gr.Blocks) -> None:
    shown = [w["status"], w["plot"], w["log"], w["stop"]]
    refresh = _refresh(ui)
    w["timer"].tick(refresh, [lang, w["run"]], shown, show_progress="hidden")
    w["run"].change(refresh, [lang, w["run"]], shown, show_progress="hidden")
    w["refresh"].click(lambda: run_choices(ui), None, w["run"]).then(refresh, [lang, w["run"]], shown)
    w["stop"].click(_stop(ui), [lang, w["run"]], w["msg"])
    w["resume"].click(_resume(ui), [lang, w["run"]], w["msg"]).then(refresh, [lang, w["run"]], shown)
    w["to_form"].click(_to_form(ui), [lang, w["run"]], [w["msg"], ui.keep, *ui.field_outputs()])
    demo.load(lambda: run_choices(ui, select_newest=True), None, w["run"])


def run_choices(ui: Ui, select_newest: bool = False, select: str | None = None) -> Any:
    runs = ui.registry.list_runs()
    choices = [r["output_dir"] for r in runs]  # newest first; the state is shown below, kept live
    if select is not None:
        return gr.update(choices=choices, value=select)
    if select_newest and runs:
        return gr.update(choices=choices, value=runs[0]["output_dir"])
    return gr.update(choices=choices)


def _curve(view: RunView) -> pd.DataFrame | None:
    """step (int), loss (float), series (train | eval); None before the first point (an empty frame
    would fix the plot's colour scale to no series at all)."""
    if not view.loss and not view.eval_loss:
        return None
    points = [(s, v, "train") for s, v in view.loss] + [(s, v, "eval") for s, v in view.eval_loss]
    return pd.DataFrame(
        {
            "step": pd.Series([p[0] for p in points], dtype="int64"),
            "loss": pd.Series([p[1] for p in points], dtype="float64"),
            "series": pd.Series([p[2] for p in points], dtype="object"),
        }
    )


def status_html(view: RunView, lang: str) -> str:
    parts = [f"<b class='lm-state lm-state-{view.state}'>{t('state_' + view.state, lang)}</b>"]
    if view.exit_code is not None:
        parts.append(t("exit_code", lang, code=view.exit_code))
    if view.total:
        parts.append(t("progress", lang, step=view.step, total=view.total, pct=view.percentage))
        parts += [t("elapsed", lang, elapsed=view.elapsed), t("eta", lang, eta=view.remaining)]
    elif view.state == "running":
        parts.append(t("waiting", lang))
    if view.tokens_per_sec:
        parts.append(t("speed", lang, tps=view.tokens_per_sec))
    if view.gpu_memory:
        parts.append(html.escape(view.gpu_memory))
    lines = [" · ".join(parts)]
    if view.total:
        lines.append(f"<progress value='{view.step}' max='{view.total}'></progress>")
    if view.loss:
        step, loss = view.loss[-1]
        lines.append(t("loss_points", lang, n=len(view.loss), loss=f"{loss:.4f}", step=step))
    errors = [ln for ln in view.log_tail.splitlines() if ln.startswith("error:")]
    if view.state == "failed" and errors:
        lines.append(f"<span class='lm-error'>{html.escape(errors[-1])}</span>")
    return "<div class='lm-run'>" + "<br>".join(lines) + "</div>"


def _refresh(ui: Ui):
    def run(lang_label: str, output_dir: str | None) -> tuple:
        lang = LANGS.get(lang_label, "en")
        if not output_dir:
            return t("no_run", lang), None, "", gr.update(interactive=False)
        view = ui.registry.view(output_dir)
        stoppable = gr.update(interactive=view.state == "running")  # nothing to stop once it ended
        return status_html(view, lang), _curve(view), view.log_tail, stoppable

    return run


def _stop(ui: Ui):
    @guarded(1)
    def run(lang_label: str, output_dir: str | None) -> str:
        lang = LANGS.get(lang_label, "en")
        if output_dir and ui.registry.stop(output_dir):
            return message(t("stop_sent", lang))
        return message(t("not_running", lang), ok=False)

    return run


def _resume(ui: Ui):
    @guarded(1)
    def run(lang_label: str, output_dir: str | None) -> str:
        lang = LANGS.get(lang_label, "en")
        config = ui.registry.run_dir(output_dir or "") / CONFIG_NAME
        if not output_dir or not config.is_file():
            return message(t("no_run", lang), ok=False)
        ui.registry.start(read_yaml(config), resume=True)
        return message(t("resumed", lang, out=output_dir))

    return run


def _to_form(ui: Ui):
    load = _load(ui)

    def run(lang_label: str, output_dir: str | None) -> tuple:
        return load(
            lang_label, str(ui.registry.run_dir(output_dir or "") / CONFIG_NAME) if output_dir else ""
        )

    return run
