"""The Jinja environment chat templates render in: transformers' sandbox, with values kept small.

The line budget of `bounded.py` bounds how long a render runs, but one line can still build a huge
value: `{{ 'x' * 10**9 }}` (a gigabyte in one multiplication), `{% set s = s ~ s %}` forty times
(2^40 characters in 40 lines), `'x'.ljust(10**10)`, `10**10**10` (an integer that takes hours to
compute). This environment refuses such an operation before it runs: `*`, `+`, `%`, `**` and `~`,
the string methods and filters that take a width or grow a string, and the rendered output are held
to MAX_TEMPLATE_CHARS characters (items, for a list), and a power to MAX_POWER_BITS bits; a value any
other call returns is checked after it. No real chat template comes near these: a 128k-token
conversation renders to well under a million characters.

`install()` makes transformers compile every chat template in this environment (its own cached
compiler is replaced), configured as transformers configures its own: the same extensions (the
`{% generation %}` tracker, loop controls), filters and globals.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from typing import Any

from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_TEMPLATE_CHARS = 1 << 24  # characters in one value or one render (16.7 M; a real one is < 1 M)
MAX_POWER_BITS = 4096
MAX_INDENT = 256  # tojson's indent repeats per line and nesting level
_BIG_FORMAT_WIDTH = re.compile(r"\d{8,}")  # a width or precision of 10^7 and more in a format string
_WIDTH_METHODS = frozenset({"ljust", "rjust", "center", "zfill", "expandtabs"})


class TemplateTooLarge(SecurityError):
    """A template operation would build a value past the bound (a memory or CPU bomb)."""


def _refuse(what: str) -> None:
    raise TemplateTooLarge(f"{what} is past the bound of {MAX_TEMPLATE_CHARS} characters")


def _check_size(value: Any, what: str) -> Any:
    if isinstance(value, (str, list, tuple, dict)) and len(value) > MAX_TEMPLATE_CHARS:
        _refuse(what)
    return value


def _sized(value: Any) -> bool:
    return isinstance(value, (str, list, tuple))


def _check_format(fmt: str, args: Any) -> None:
    if _BIG_FORMAT_WIDTH.search(fmt):
        _refuse(f"a format width in {fmt[:40]!r}")
    values = args.values() if isinstance(args, dict) else args if isinstance(args, tuple) else (args,)
    if any(isinstance(v, int) and abs(v) > MAX_TEMPLATE_CHARS for v in values):
        _refuse("a '*' width given to a '%' format")


def _check_binop(op: str, left: Any, right: Any) -> None:
    if op == "*":
        for seq, times in ((left, right), (right, left)):
            if _sized(seq) and isinstance(times, int) and len(seq) * times > MAX_TEMPLATE_CHARS:
                _refuse(f"a value repeated {times} times")
    elif op == "+" and _sized(left) and _sized(right) and len(left) + len(right) > MAX_TEMPLATE_CHARS:
        _refuse("the sum of two values")
    elif op == "%" and isinstance(left, str):
        _check_format(left, right)
    elif op == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        if right * abs(left).bit_length() > MAX_POWER_BITS:
            raise TemplateTooLarge(f"{left} ** {right} is past the bound of {MAX_POWER_BITS} bits")


def _replaced_length(text: str, old: str, new: str, count: int = -1) -> int:
    hits = text.count(old) if old else len(text) + 1
    if count >= 0:
        hits = min(hits, count)
    return len(text) + hits * (len(new) - len(old))


def _check_join(sep: str, items: Iterable[Any]) -> list:
    pieces = list(items)
    total = sum(len(p) if isinstance(p, str) else len(str(p)) for p in pieces)
    if total + len(sep) * max(len(pieces) - 1, 0) > MAX_TEMPLATE_CHARS:
        _refuse("a join")
    return pieces


def _check_str_method(text: str, name: str, args: tuple, kwargs: dict) -> tuple:
    """Refuses before it runs a string method whose result would pass the bound."""
    if name in _WIDTH_METHODS and any(isinstance(a, int) and a > MAX_TEMPLATE_CHARS for a in args):
        _refuse(f"the width given to {name}()")
    if name == "format" and _BIG_FORMAT_WIDTH.search(text):
        _refuse(f"a format width in {text[:40]!r}")
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        if _replaced_length(text, *args[:2], *args[2:3]) > MAX_TEMPLATE_CHARS:
            _refuse("the result of replace()")
    if name == "join" and args:
        return (_check_join(text, args[0]), *args[1:])
    return args


def _check_filter(name: str, args: tuple, kwargs: dict) -> tuple:
    """Refuses before it runs a filter whose result would pass the bound; the filter's value and
    arguments as given (a join's items read once)."""
    value = args[0] if args else None
    if name in {"center", "indent", "wordwrap", "truncate"}:
        width = args[1] if len(args) > 1 else kwargs.get("width", kwargs.get("length", 0))
        lines = value.count("\n") + 1 if isinstance(value, str) and name == "indent" else 1
        if isinstance(width, int) and width * lines > MAX_TEMPLATE_CHARS:
            _refuse(f"the width given to the {name} filter")
    elif name == "replace" and len(args) >= 3 and all(isinstance(a, str) for a in args[:3]):
        if _replaced_length(*args[:3], *args[3:4]) > MAX_TEMPLATE_CHARS:
            _refuse("the result of the replace filter")
    elif name == "join" and value is not None and not isinstance(value, str):
        sep = args[1] if len(args) > 1 else kwargs.get("d", "")
        return (_check_join(sep if isinstance(sep, str) else "", value), *args[1:])
    elif name == "format" and isinstance(value, str):
        _check_format(value, tuple(args[1:]) or kwargs)
    elif name == "tojson":
        indent = args[2] if len(args) > 2 else kwargs.get("indent")
        if (isinstance(indent, int) and indent > MAX_INDENT) or (
            isinstance(indent, str) and len(indent) > MAX_INDENT
        ):
            raise TemplateTooLarge(f"tojson's indent {indent!r} is past the bound of {MAX_INDENT}")
    return args


def _bounded_filter(name: str, func: Callable) -> Callable:
    @functools.wraps(func)
    def run(*args: Any, **kwargs: Any) -> Any:
        # Jinja passes the context or environment first to filters marked pass_context/pass_environment
        skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0
        args = (*args[:skip], *_check_filter(name, args[skip:], kwargs))
        return _check_size(func(*args, **kwargs), f"the result of the {name} filter")

    return run


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles `a ~ b` to a join that checks the total length first (Jinja's own `str_join` is a
    plain module function the environment cannot intercept)."""

    def visit_Concat(self, node: Any, frame: Any) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("), context.eval_ctx)")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's signature)
        # the sandbox hands out str.format wrapped; the wrapper keeps the bound method as __wrapped__
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        if isinstance(owner, str):
            args = _check_str_method(owner, getattr(__obj, "__name__", ""), args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        return _check_size(result, f"the result of {getattr(__obj, '__name__', 'a call')}()")

    def format_string(self, s: str, args: tuple, kwargs: dict, format_func: Any = None) -> str:  # type: ignore[override]
        if _BIG_FORMAT_WIDTH.search(s):
            _refuse(f"a format width in {s[:40]!r}")
        return super().format_string(s, args, kwargs, format_func)

    def bounded_concat(self, values: tuple, eval_ctx: Any) -> str:
        from jinja2.runtime import markup_join, str_join

        if sum(len(v) if isinstance(v, str) else len(str(v)) for v in values) > MAX_TEMPLATE_CHARS:
            _refuse("a '~' concatenation")
        return markup_join(values) if eval_ctx.autoescape else str_join(values)

    def concat(self, pieces: Iterable[str]) -> str:  # type: ignore[override]  # Jinja's concat is a plain join
        kept: list[str] = []
        total = 0
        for piece in pieces:
            total += len(piece)
            if total > MAX_TEMPLATE_CHARS:
                _refuse("the rendered text")
            kept.append(piece)
        return "".join(kept)


def _like(base: ImmutableSandboxedEnvironment) -> BoundedSandbox:
    env = BoundedSandbox(
        trim_blocks=base.trim_blocks,
        lstrip_blocks=base.lstrip_blocks,
        extensions=[type(ext) for ext in base.extensions.values()],
    )
    env.globals.update(base.globals)
    env.tests.update(base.tests)
    env.filters.update({name: _bounded_filter(name, f) for name, f in base.filters.items()})
    return env


def install() -> None:
    """transformers compiles chat templates in a BoundedSandbox from now on (idempotent)."""
    from transformers.utils import chat_template_utils as ctu

    if getattr(ctu._compile_jinja_template, "lmstack_bounded", False):
        return
    # transformers' own configuration, read from the environment it builds for an empty template
    env = _like(ctu._cached_compile_jinja_template("").environment)

    @functools.lru_cache
    def compile_bounded(chat_template: str) -> Any:
        return env.from_string(chat_template)

    compile_bounded.lmstack_bounded = True  # type: ignore[attr-defined]
    ctu._compile_jinja_template = compile_bounded
