"""Reward functions shipped with lmstack, named in `reward_funcs` by their short names (stages grpo / rloo):

- `accuracy`: 1.0 when the answer's final result equals the dataset's reference answer (the record's
  response column, handed to the reward as TRL's `solution` column), else 0.0; None (TRL leaves the
  answer out of this reward) where the record has no reference. The final result is the last
  <answer>...</answer>, else the last \\boxed{...}, else the text after '####', else the last number.
  Two results are equal as numbers (integers, decimals, fractions, \\frac, thousands separators, a
  trailing %), else as expressions (a small, safe sympy check: digits, + - * / ^, sqrt, pi, one-letter
  variables), else as normalised text.
- `format`: 1.0 when the whole answer matches `format_reward_pattern` (default
  <think>...</think><answer>...</answer>), else 0.0.
- `length`: 1 - answer tokens / max_new_tokens (1.0 for an empty answer, 0.0 at the length limit).

Each follows TRL's reward-function contract: f(prompts, completions, completion_ids, **columns) ->
one float (or None) per completion; TRL logs each as rewards/<name>/mean."""

from __future__ import annotations

import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from lmstack.config.schema import Config

SOLUTION_COLUMN = "solution"  # TRL's name for the reference answer (trl.rewards.accuracy_reward reads it)


# ---- extracting the final result ----------------------------------------------------------------
def _text(completion: Any) -> str:
    """TRL passes a plain string, or a list of messages for conversational prompts."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}), braces balanced."""
    starts = [m.end() for m in BOX_OPEN.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i].strip()
    return None  # unbalanced: the answer was cut off


NUMBER = r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+"


def last_number(text: str) -> str | None:
    found = re.findall(NUMBER, text)
    return found[-1].rstrip(",") if found else None


def extract_answer(text: str) -> str | None:
    """A completion's final result: last <answer> tag, last \\boxed{}, text after '####', last number."""
    tags = re.findall(r"<answer>(.*?)</answer>", text, flags=re.DOTALL)
    if tags:
        text = tags[-1]
        boxed = last_boxed(text)
        return boxed if boxed is not None else text.strip() or None
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if BOX_OPEN.search(text):
        return None  # a \boxed{ never closed: the answer was cut off, no number in it counts
    hashes = re.findall(r"####\s*(.+)", text)
    if hashes:
        return hashes[-1].strip()
    return last_number(text)


def reference_answer(solution: str) -> str | None:
    """The dataset's reference: its \\boxed{} or '####' result, the whole text when it is one short
    result (e.g. '72', '\\frac{1}{2}'), else its last number."""
    solution = (solution or "").strip()
    if not solution:
        return None
    boxed = last_boxed(solution)
    if boxed is not None:
        return boxed
    hashes = re.findall(r"####\s*(.+)", solution)
    if hashes:
        return hashes[-1].strip()
    if len(solution) <= 40 and "\n" not in solution:
        return solution
    return last_number(solution)


# ---- comparing two results ----------------------------------------------------------------------
def _strip_latex(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\text\{([^{}]*)\}|\\mathrm\{([^{}]*)\}", lambda m: m.group(1) or m.group(2) or "", s)
    s = re.sub(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", r"(\1)/(\2)", s)
    s = re.sub(r"\\sqrt\s*\{([^{}]*)\}", r"sqrt(\1)", s)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\cdot", "*"), ("\\times", "*"), ("\\pi", "pi")):
        s = s.replace(old, new)
    s = s.replace("\\$", "").replace("\\%", "%").replace("\\,", "").replace("\\!", "").replace("{", "(")
    s = s.replace("}", ")")
    return s.strip().rstrip(".").strip()


def to_number(s: str) -> Fraction | None:
    """'1,234' / '-3.5' / '7/2' / '(7)/(2)' / '50%' / '$12' -> an exact Fraction (None if not a number)."""
    s = _strip_latex(s).replace(" ", "")
    s = s.removesuffix("%")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    frac = re.fullmatch(r"\(?(-?\d+(?:\.\d+)?)\)?/\(?(-?\d+(?:\.\d+)?)\)?", s)
    try:
        if frac:
            den = Fraction(frac.group(2))
            return Fraction(frac.group(1)) / den if den else None
        if re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)", s):
            return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return None


SAFE_EXPRESSION = re.compile(r"(?:\d+(?:\.\d+)?|sqrt|pi|[a-z]|[-+*/^() ])+")


def _sympy_value(s: str) -> Any | None:
    """A sympy expression from a short, whitelisted string (no names other than sqrt, pi and one-letter
    variables reach the parser; powers bounded), else None."""
    s = _strip_latex(s).replace(" ", "")
    if (
        not s
        or len(s) > 64
        or not SAFE_EXPRESSION.fullmatch(s)
        or re.search(r"[a-z]{2,}", re.sub(r"sqrt|pi", "", s))
    ):
        return None
    if s.count("^") > 1 or any(len(m) > 2 for m in re.findall(r"\^\(?(\d+)", s)):
        return None  # 9^9^9 would never finish
    try:
        import sympy
        from sympy.parsing.sympy_parser import (
            convert_xor,
            implicit_multiplication_application,
            parse_expr,
            standard_transformations,
        )
    except ImportError:
        return None
    names = {c: sympy.Symbol(c) for c in set(re.findall(r"[a-z]", re.sub(r"sqrt|pi", "", s)))}
    names.update(sqrt=sympy.sqrt, pi=sympy.pi)
    try:
        return parse_expr(
            s,
            local_dict=names,
            global_dict={"__builtins__": {}, "Integer": sympy.Integer, "Float": sympy.Float,
                         "Rational": sympy.Rational, "Symbol": sympy.Symbol},
            transformations=(*standard_transformations, implicit_multiplication_application, convert_xor),
        )  # fmt: skip
    except Exception:  # noqa: BLE001 - any parse failure means "not an expression"
        return None


def _normal_text(s: str) -> str:
    return re.sub(r"\s+", "", _strip_latex(s)).lower()


def answers_equal(predicted: str | None, reference: str | None) -> bool:
    if predicted is None or reference is None:
        return False
    a, b = to_number(predicted), to_number(reference)
    if a is not None and b is not None:
        return a == b or abs(float(a) - float(b)) <= 1e-6 * max(1.0, abs(float(b)))
    if "," in predicted and "," in reference and a is None and b is None:
        left, right = _items(predicted), _items(reference)
        if len(left) == len(right) > 1:
            return all(answers_equal(x, y) for x, y in zip(left, right))
    if _normal_text(predicted) == _normal_text(reference):
        return True
    x, y = _sympy_value(predicted), _sympy_value(reference)
    if x is None or y is None:
        return False
    try:
        import sympy

        return bool(sympy.simplify(x - y) == 0)
    except Exception:  # noqa: BLE001 - sympy cannot decide: not equal
        return False


def _items(s: str) -> list[str]:
    return [p.strip() for p in _strip_latex(s).strip("()[]").split(",")]


# ---- the reward functions -----------------------------------------------------------------------
def accuracy(prompts: list, completions: list, completion_ids: list, **columns: Any) -> list[float | None]:
    solutions = columns.get(SOLUTION_COLUMN) or [None] * len(completions)
    out: list[float | None] = []
    for completion, solution in zip(completions, solutions):
        reference = reference_answer(solution) if solution else None
        out.append(
            None if reference is None else float(answers_equal(extract_answer(_text(completion)), reference))
        )
    return out


def format_reward(pattern: str) -> Callable:
    compiled = re.compile(pattern, flags=re.DOTALL)

    def format(prompts: list, completions: list, completion_ids: list, **_: Any) -> list[float]:  # noqa: A001
        return [1.0 if compiled.search(_text(c)) else 0.0 for c in completions]

    return format


def length_reward(max_new_tokens: int) -> Callable:
    def length(prompts: list, completions: list, completion_ids: list, **_: Any) -> list[float]:
        return [max(0.0, 1.0 - len(ids) / max_new_tokens) for ids in completion_ids]

    return length


def shipped_reward(name: str, cfg: Config) -> Callable:
    if name == "accuracy":
        return accuracy
    if name == "format":
        return format_reward(cfg.finetuning.format_reward_pattern)
    if name == "length":
        return length_reward(cfg.generating.max_new_tokens)
    raise KeyError(name)
