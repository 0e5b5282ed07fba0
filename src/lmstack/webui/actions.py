"""What the web UI's buttons do, as plain functions over the flat YAML (no gradio here): the data
preview (`lmstack check`), the memory plan (`lmstack plan`), YAML load, export, and the chat model.
Each calls the library the CLI calls, so the UI and the CLI cannot drift apart."""

from __future__ import annotations

import html
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmstack.config.load import build_config, load_yaml

logger = logging.getLogger(__name__)


class LogCapture(logging.Handler):
    """The log lines an action writes, shown under its result."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def __enter__(self) -> LogCapture:
        root = logging.getLogger("lmstack")
        self._level = root.level
        root.addHandler(self)
        if root.getEffectiveLevel() > logging.INFO:
            root.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc: object) -> None:
        root = logging.getLogger("lmstack")
        root.removeHandler(self)
        root.setLevel(self._level)


def example_html(segments: list[dict]) -> str:
    """The rendered training example: trained tokens highlighted, masked ones dimmed."""
    parts = []
    for seg in segments:
        text = html.escape(seg["text"])
        css = "lm-trained" if seg["trained"] else "lm-masked"
        parts.append(f'<span class="{css}">{text}</span>')
    return '<pre class="lm-example">' + "".join(parts) + "</pre>"


def preview_data(flat: dict[str, Any]) -> tuple[str, str]:
    """(what `lmstack check` prints, the example as HTML). Writes data_report.json into output_dir."""
    from lmstack.cli.check import run_check
    from lmstack.data.validate import format_report
    from lmstack.webui.media_view import media_html

    report, path = run_check(None, dict(flat))
    text = format_report(report, color=False) + f"\n\nreport written to {path}"
    return text, media_html(flat, report) + example_html(report.get("example") or [])


def plan_table(flat: dict[str, Any], gpus: int, gpu_memory_gib: float) -> tuple[str, dict[str, Any]]:
    """(`lmstack plan`'s table, the recommendation's YAML changes) for `gpus` GPUs of `gpu_memory_gib`:
    `lmstack plan cfg.yaml --gpus G --gpu-memory M`'s own planning, for the machine that will train."""
    from lmstack.cli.plan import plan_target, plan_text
    from lmstack.memory import plan
    from lmstack.models.load import check_model_path

    cfg = build_config(dict(flat))
    check_model_path(cfg, model_type=False)  # as `lmstack plan` (the data's lengths need the tokenizer)
    run_plan, req = plan_target(cfg, gpus, gpu_memory_gib)
    result = plan(req)
    changes = dict(result.recommendation.yaml_changes) if result.recommendation else {}
    return plan_text(run_plan, result), changes


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML file as `lmstack train` reads it (same duplicate-key and syntax errors)."""
    return load_yaml(path)


def export_model(flat: dict[str, Any]) -> str:
    """`lmstack export` on the form's YAML; returns what was written."""
    from lmstack.infer.export import export

    with LogCapture() as logs:
        out = export(None, dict(flat))
    files = sorted(p.name for p in Path(out).iterdir())
    return "\n".join([*logs.lines, f"exported to {out}: {', '.join(files)}"])


GENERATION_KEYS = ("max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "repetition_penalty")


class ChatModel:
    """The one model the Chat tab talks to (loaded in the UI process: inference only)."""

    def __init__(self) -> None:
        self.engine: Any = None
        self.source = ""
        self._lock = threading.Lock()

    def load(self, flat: dict[str, Any]) -> str:
        from lmstack.infer.engine import ChatEngine, adapter_dirs, load_infer_config

        with self._lock, LogCapture() as logs:
            self.engine = None
            cfg = load_infer_config(None, dict(flat))
            self.engine = ChatEngine.from_config(cfg)
            adapters = adapter_dirs(cfg)
            self.source = cfg.model.model_name_or_path + (f" + {', '.join(adapters)}" if adapters else "")
        return "\n".join([*logs.lines, f"loaded {self.source}"])

    def unload(self) -> None:
        with self._lock:
            self.engine, self.source = None, ""
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass

    def reply(self, history: list[dict], system: str, settings: dict[str, Any]) -> Iterator[str]:
        """Streams the reply to `history` (which ends with the user's turn)."""
        engine = self.engine
        if engine is None:
            raise RuntimeError("no model loaded")
        messages = [{"role": m["role"], "content": _text(m["content"])} for m in history]
        overrides = {k: settings[k] for k in GENERATION_KEYS if k in settings}
        stream = engine.stream(messages, system or None, **overrides)
        try:
            yield from stream
        finally:
            stream.close()


def _text(content: Any) -> str:
    """A chat message's text (gradio may hand content over as a list of parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    if isinstance(content, dict):
        return str(content.get("text", ""))
    return str(content)
