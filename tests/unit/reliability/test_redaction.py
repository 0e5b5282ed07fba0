"""Secrets never reach a log line, a traceback, a warning or a saved config."""

from __future__ import annotations

import logging
import sys
import warnings

import pytest
import yaml

from lmstack.config import secrets
from lmstack.config.load import build_config, save_config


@pytest.fixture
def clean_registry(monkeypatch):
    monkeypatch.setattr(secrets, "_values", set())


def test_patterns_and_registered_values_are_masked(clean_registry):
    secrets.register("plain-value-without-prefix-42")
    text = (
        "hf hf_AbCdEf0123456789xyz openai sk-proj-abcdefghijklmnop1234 "
        "header Authorization: Bearer abc.def-ghi_123456 raw plain-value-without-prefix-42 ok"
    )
    clean = secrets.redact(text)
    assert "hf_AbCd" not in clean and "sk-proj" not in clean and "abc.def" not in clean
    assert "plain-value" not in clean and clean.endswith("*** ok")
    assert "Authorization: Bearer ***" in clean
    secrets.register("abc")  # too short to mask without hitting ordinary words
    assert secrets.redact("abc") == "abc"


def test_env_names_that_look_secret(clean_registry):
    secrets.register_env(
        {
            "HF_TOKEN": "tok-value-1234",
            "WANDB_API_KEY": "wandb-value-1234",
            "TOKENIZERS_PARALLELISM": "false-ish",
        }
    )
    assert secrets.redact("tok-value-1234 wandb-value-1234 false-ish") == "*** *** false-ish"


def test_log_records_exceptions_and_warnings_are_redacted(clean_registry, monkeypatch, capsys):
    original_factory = logging.getLogRecordFactory()
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    try:
        secrets.install()
        secrets.register("my-tracker-key-0042")
        logger = logging.getLogger("lmstack.test_redaction")
        handler = logging.StreamHandler(sys.stdout)
        logger.addHandler(handler)
        monkeypatch.setattr(logger, "propagate", False)  # only this handler: others may hold closed streams
        try:
            logger.warning("token %s and key %s", "hf_Secret0123456789", "my-tracker-key-0042")
            try:
                raise RuntimeError("failed with hf_InException0123456")
            except RuntimeError:
                logger.exception("boom")
        finally:
            logger.removeHandler(handler)
        sys.excepthook(ValueError, ValueError("uncaught sk-abcdefghijklmnop0000"), None)
        shown = warnings.formatwarning("warned hf_InWarning0123456", UserWarning, "f.py", 1)
    finally:
        logging.setLogRecordFactory(original_factory)
    out = capsys.readouterr()
    text = out.out + out.err + shown
    for leaked in ("hf_Secret", "my-tracker-key", "hf_InException", "sk-abcdef", "hf_InWarning"):
        assert leaked not in text, leaked
    assert "token *** and key ***" in out.out and "RuntimeError: failed with ***" in out.out


def test_config_secrets_are_registered_and_saved_redacted(clean_registry, tmp_path):
    cfg = build_config(
        {"model_name_or_path": "m", "output_dir": str(tmp_path), "hf_hub_token": "a-token-value-123"}
    )
    assert secrets.redact("x a-token-value-123 y") == "x *** y"
    assert "a-token-value-123" not in repr(cfg)
    save_config(cfg, tmp_path / "c.yaml")
    assert yaml.safe_load((tmp_path / "c.yaml").read_text())["hf_hub_token"] == "***"


def test_token_like_text_in_any_field_is_masked_in_the_saved_config(clean_registry, tmp_path):
    token = "hf_AbCdEf0123456789xyz"
    cfg = build_config(
        {"model_name_or_path": "m", "output_dir": str(tmp_path), "default_system": f"use key {token}"}
    )
    save_config(cfg, tmp_path / "c.yaml")
    saved = yaml.safe_load((tmp_path / "c.yaml").read_text())
    assert token not in (tmp_path / "c.yaml").read_text() and saved["default_system"] == "use key ***"
