"""API safety rules that need no model: bind checks and the JSON 500 handler."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config
from lmstack.infer.server import check_bind, create_app, is_loopback


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2", "[::1]"])
def test_loopback_hosts_need_no_key(host):
    assert is_loopback(host)
    check_bind(host, None)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5", "example.com"])
def test_other_hosts_need_a_key(host):
    assert not is_loopback(host)
    with pytest.raises(ConfigError, match=f"--host: {host} is reachable .* --api-key KEY or set API_KEY"):
        check_bind(host, None)
    check_bind(host, "k")


class BrokenEngine:
    """An engine whose generation fails unexpectedly (a bug, an OOM)."""

    cfg = build_config({"model_name_or_path": "m", "output_dir": "o", "max_new_tokens": 4})
    max_length = None

    def prompt_ids(self, messages, system=None):
        return [1, 2, 3]

    def generate(self, *args, **kwargs):
        raise RuntimeError("CUDA out of memory (secret detail)")

    stream = generate


def test_unexpected_failures_are_a_json_500_without_traceback():
    client = TestClient(create_app(BrokenEngine(), "m", "k"), raise_server_exceptions=False)
    r = client.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": "Bearer k"},
    )
    assert r.status_code == 500
    assert r.json()["error"] == {
        "message": "internal error (RuntimeError); see the server log",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    assert "Traceback" not in r.text and "secret" not in r.text


def test_a_failing_stream_reports_in_band_and_still_ends_with_done():
    client = TestClient(create_app(BrokenEngine(), "m", "k"), raise_server_exceptions=False)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    r = client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer k"})
    events = [e for e in r.text.split("\n\n") if e]
    assert r.status_code == 200
    assert events == [
        'data: {"error": {"message": "generation failed (RuntimeError)", "type": "server_error"}}',
        "data: [DONE]",
    ]
