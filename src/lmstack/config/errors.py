"""Error types that name the field, the value received, the allowed values and the fix."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class LmstackError(Exception):
    """Base class: an error a user can fix. The CLI prints `str(err)` without a traceback."""


class ConfigError(LmstackError):
    """A problem with the YAML / command-line configuration."""


class DataError(LmstackError):
    """A problem with a dataset file, its registry entry or its records."""


def closest(word: str, choices: Iterable[str], n: int = 1, cutoff: float = 0.6) -> list[str]:
    return difflib.get_close_matches(word, list(choices), n=n, cutoff=cutoff)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    match = closest(str(word), choices)
    return f" (did you mean '{match[0]}'?)" if match else ""


def enum_error(field: str, value: object, allowed: Iterable[str]) -> ConfigError:
    allowed = list(allowed)
    return ConfigError(
        f"{field}: got {value!r}; allowed: {' | '.join(allowed)}{did_you_mean(str(value), allowed)}"
    )


MAX_SHOWN = 200  # characters of a value quoted in an error message


def short(value: object, limit: int = MAX_SHOWN) -> str:
    """repr() of a value for a message, bounded: a huge or deeply nested value (a YAML alias bomb,
    a pasted file) is cut, never expanded in full."""
    import reprlib

    bounded = reprlib.Repr()
    bounded.maxlevel, bounded.maxstring, bounded.maxother = 3, limit, limit
    bounded.maxdict = bounded.maxlist = bounded.maxtuple = bounded.maxset = 8
    text = bounded.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
