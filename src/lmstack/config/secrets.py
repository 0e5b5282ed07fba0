"""Secret redaction: known secret values (config SecretStr fields, token-like env vars) and token
patterns (hf_..., sk-..., wandb keys) are replaced by `***` in log records, exception messages and
text written by `redact`. Nothing happens at import: the CLI calls `install()`."""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from typing import Any

MASK = "***"
# names ending like HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, hf_hub_token, api_key
SECRET_NAME = re.compile(
    r"(?:^|_)(TOKEN|API_KEY|APIKEY|SECRET|SECRET_KEY|PASSWORD|ACCESS_KEY|PRIVATE_KEY|AUTH)$", re.IGNORECASE
)
PATTERNS = [
    re.compile(r"\bhf_[A-Za-z0-9]{8,}"),  # Hugging Face
    re.compile(r"\bsk-(?:proj-|ant-)?[A-Za-z0-9_\-]{12,}"),  # OpenAI / Anthropic style
    re.compile(r"\bghp_[A-Za-z0-9]{20,}"),  # GitHub
    re.compile(r"\bxox[abpr]-[A-Za-z0-9\-]{10,}"),  # Slack
    re.compile(r"(?i)(authorization:\s*bearer\s+)[A-Za-z0-9._\-]{8,}"),
]
MIN_SECRET_LEN = 6  # shorter values (e.g. "1", "true") would mask ordinary words

_lock = threading.Lock()
_values: set[str] = set()


def register(value: Any) -> None:
    """Remember a secret value so every later `redact` masks it."""
    if hasattr(value, "get_secret_value"):
        value = value.get_secret_value()
    if isinstance(value, str) and len(value) >= MIN_SECRET_LEN:
        with _lock:
            _values.add(value)


def register_env(environ: dict[str, str] | None = None) -> None:
    """Values of env vars whose name looks secret (HF_TOKEN, WANDB_API_KEY, OPENAI_API_KEY, ...)."""
    for name, value in (os.environ if environ is None else environ).items():
        if SECRET_NAME.search(name):
            register(value)


def register_config(cfg: Any) -> None:
    """Every SecretStr field of a Config (or any pydantic model with sections)."""
    from pydantic import BaseModel, SecretStr

    def walk(obj: Any) -> None:
        if isinstance(obj, BaseModel):
            for name in type(obj).model_fields:
                walk(getattr(obj, name))
        elif isinstance(obj, SecretStr):
            register(obj)

    walk(cfg)


def register_flat(flat: dict[str, Any]) -> None:
    """Raw YAML values under secret-looking keys, before validation can echo them in an error."""
    for key, value in flat.items():
        if SECRET_NAME.search(str(key)):
            register(value)


def redact(text: str) -> str:
    if not text:
        return text
    with _lock:
        values = sorted(_values, key=len, reverse=True)
    for value in values:
        if value in text:
            text = text.replace(value, MASK)
    for pattern in PATTERNS:
        text = pattern.sub(lambda m: (m.group(1) if m.groups() else "") + MASK, text)
    return text


def _redact_record(record: logging.LogRecord) -> logging.LogRecord:
    try:
        message = record.getMessage()
    except Exception:  # a bad format string is not ours to fix; leave the record alone
        return record
    clean = redact(message)
    if clean != message:
        record.msg, record.args = clean, None
    if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
        import traceback

        record.exc_text = redact("".join(traceback.format_exception(*record.exc_info)).rstrip())
    return record


def _redacting_excepthook(kind, value, tb) -> None:
    import traceback

    sys.stderr.write(redact("".join(traceback.format_exception(kind, value, tb))))


def install() -> None:
    """Redact every log record at creation (any logger, any handler, transformers' included),
    uncaught exceptions and warnings. Idempotent; the CLI calls it once at start."""
    import warnings

    register_env()
    factory = logging.getLogRecordFactory()
    if not getattr(factory, "_lmstack_redacting", False):

        def redacting_factory(*args, **kwargs):
            return _redact_record(factory(*args, **kwargs))

        redacting_factory._lmstack_redacting = True  # type: ignore[attr-defined]
        logging.setLogRecordFactory(redacting_factory)
    sys.excepthook = _redacting_excepthook
    if not getattr(warnings.formatwarning, "_lmstack_redacting", False):
        original = warnings.formatwarning

        def formatwarning(*args, **kwargs):
            return redact(original(*args, **kwargs))

        formatwarning._lmstack_redacting = True  # type: ignore[attr-defined]
        warnings.formatwarning = formatwarning


def holds_secret(flat: dict[str, Any]) -> bool:
    """A flat config with a value under a secret-looking key (hf_hub_token, ...) or a token-like
    text anywhere (an hf_... token pasted into default_system)."""
    if any(SECRET_NAME.search(str(k)) and v not in (None, "") for k, v in flat.items()):
        return True
    text = " ".join(str(v) for v in flat.values())
    return any(pattern.search(text) for pattern in PATTERNS)


def write_text(path: Any, text: str, private: bool) -> None:
    """Writes `text` to `path`; `private`: readable by its owner only (0600, also when the file was
    there before), since the umask (often 022) would let every local user read a token in it."""
    if not private:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
