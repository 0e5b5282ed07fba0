"""A tokenizer's chat template is code from the model folder: rendering it is bounded.

transformers renders chat templates in Jinja's `ImmutableSandboxedEnvironment`, which stops attribute
escapes but not work: `{% for i in range(100000) %}{% for j in range(100000) %}` runs for hours, and
`check`, `train` (which renders every record several times) and the API server would hang on it.
`bounded_render(name)` counts the lines of compiled template code a render runs (Jinja compiles a
template to Python, whose frames carry the file name `<template>`; a line tracer sees only those
frames) and stops the render past MAX_TEMPLATE_LINES, a deterministic work budget that no chat
template of a real model comes near (a 200-turn conversation with tools runs some 10^4 lines). A
render the sandbox refuses (`SecurityError`: `__class__`, `mro`, ...) is the same plain error, and so
is one that would build a value past the size bound of `sandbox.py` (a memory bomb on one line).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from lmstack.config.errors import ConfigError

MAX_TEMPLATE_LINES = 2_000_000
TEMPLATE_FILE = "<template>"  # the file name Jinja gives the code of a template made from a string


class _OverBudget(Exception):
    pass


def _fix(name: str) -> str:
    return (
        f"set template: <name> (see lmstack.templates.list_templates()) instead of {name}, or fix the "
        "chat_template (chat_template.jinja / tokenizer_config.json) in the model folder"
    )


@contextmanager
def bounded_render(name: str, budget: int = MAX_TEMPLATE_LINES) -> Iterator[None]:
    """Runs the block with template code limited to `budget` lines; over it, or refused by the
    sandbox, a ConfigError names the template and the fix."""
    from jinja2.exceptions import SecurityError

    from lmstack.templates.sandbox import TemplateTooLarge, install

    install()
    left = budget

    def line(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal left
        if event == "line":
            left -= 1
            if left < 0:
                raise _OverBudget
        return line

    def call(frame: FrameType, event: str, arg: Any) -> Any:
        return line if frame.f_code.co_filename == TEMPLATE_FILE else None

    previous = sys.gettrace()
    sys.settrace(call)
    try:
        yield
    except _OverBudget:
        raise ConfigError(
            f"template: {name} ran past {budget} lines of template code rendering one conversation "
            f"(a loop that does not end, or one nested too deep); {_fix(name)}"
        ) from None
    except TemplateTooLarge as err:
        raise ConfigError(
            f"template: {name} would build a value too large to render one conversation ({err}); {_fix(name)}"
        ) from None
    except SecurityError as err:
        raise ConfigError(f"template: {name} was refused by Jinja's sandbox ({err}); {_fix(name)}") from None
    finally:
        sys.settrace(previous)
