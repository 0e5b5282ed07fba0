"""lmstack's optional extras (pyproject.toml `[project.optional-dependencies]`) as data: the modules each
one brings, so a command or a field that needs one is refused before any model loads, with the line
to run (`pip install 'lmstack[wandb]'`). The README's extras table lists the same names."""

from __future__ import annotations

import importlib.util
from typing import NamedTuple

from lmstack.config.errors import ConfigError


class Extra(NamedTuple):
    modules: tuple[str, ...]  # importable module names the extra installs
    enables: str  # what it switches on, in a few words


EXTRAS: dict[str, Extra] = {
    "serve": Extra(("fastapi", "uvicorn"), "`lmstack api`, the OpenAI-compatible HTTP server"),
    "webui": Extra(("gradio",), "`lmstack webui`, the Gradio web UI"),
    "tensorboard": Extra(("tensorboard",), "report_to: tensorboard"),
    "wandb": Extra(("wandb",), "report_to: wandb (Weights & Biases; WANDB_MODE=offline works offline)"),
    "mlflow": Extra(("mlflow",), "report_to: mlflow (mlflow-skinny; a local file store works offline)"),
    "swanlab": Extra(("swanlab",), "report_to: swanlab and use_swanlab (swanlab_mode: local works offline)"),
    "trackio": Extra(("trackio",), "report_to: trackio (logs to a local database)"),
    "vllm": Extra(("vllm",), "infer_backend: vllm for `lmstack chat` / `lmstack api`"),
    "sglang": Extra(("sglang",), "infer_backend: sglang for `lmstack chat` / `lmstack api`"),
    "unsloth": Extra(("unsloth",), "use_unsloth: true (Unsloth's kernels on one CUDA GPU)"),
    "fp8": Extra(("torchao",), "fp8: true for full fine-tuning (torchao's float8 training)"),
    "optim": Extra(
        ("galore_torch", "apollo_torch", "badam", "adam_mini"),
        "use_galore, use_apollo, use_badam, use_adam_mini",
    ),
    "metrics": Extra(("jieba", "nltk", "rouge_chinese"), "predict_with_generate's BLEU-4 / ROUGE metrics"),
}


def install_line(extra: str) -> str:
    return f"pip install 'lmstack[{extra}]'"


def missing_modules(extra: str) -> list[str]:
    """The extra's modules that cannot be imported here (find_spec: nothing is imported)."""
    return [m for m in EXTRAS[extra].modules if importlib.util.find_spec(m) is None]


def require(extra: str, what: str) -> None:
    """Raise a ConfigError naming `what` (a field and value, or a command), the missing packages and
    the install line when the extra is not installed."""
    missing = missing_modules(extra)
    if missing:
        names = ", ".join(f"`{m}`" for m in missing)
        raise ConfigError(f"{what} needs {names}, which is not installed; {install_line(extra)}")
