"""`lmstack webui` started for real (a subprocess on loopback), probed over HTTP: a Host or Origin that
names another site is refused before Gradio sees the request (DNS rebinding read `/etc/shadow` through
Load YAML's error before), login guesses are throttled, and a short password on an open address is
refused before the UI starts."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

pytest.importorskip("gradio")
from tests.integration.test_webui import start_webui, stop_process  # noqa: E402


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    root = tmp_path_factory.mktemp("ui")
    (root / "users").write_text("alice:s3cret\n")
    proc, url, _ = start_webui(
        root, "127.0.0.1", "--auth-file", str(root / "users"), "--allow-host", "lab.lan"
    )
    yield url
    stop_process(proc)


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:7860"])
def test_a_foreign_host_gets_403_before_gradio(ui, host):
    for method, path in (("GET", "/"), ("POST", "/gradio_api/call/run_4"), ("POST", "/login")):
        r = httpx.request(method, f"{ui.rstrip('/')}{path}", headers={"Host": host}, json={"data": []})
        assert r.status_code == 403, (path, r.text)
        assert r.json()["error"]["message"].startswith(f"Host: {host!r} is not a name of this server")


def test_loopback_and_allowed_names_reach_the_ui_and_a_foreign_origin_does_not(ui):
    port = ui.rstrip("/").rsplit(":", 1)[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "lab.lan"):
        assert httpx.get(ui, headers={"Host": host}).status_code == 200
    r = httpx.post(
        f"{ui}login", data={"username": "alice", "password": "x"}, headers={"Origin": "https://evil.example"}
    )
    assert r.status_code == 403 and "Origin: 'https://evil.example'" in r.json()["error"]["message"]


def test_wrong_logins_are_throttled_and_then_even_the_right_one_waits(ui):
    def login(password: str) -> httpx.Response:
        return httpx.post(f"{ui}login", data={"username": "alice", "password": password})

    statuses = [login(f"guess{i}").status_code for i in range(10)]
    assert statuses == [400] * 10  # Gradio's "Incorrect credentials."
    for password in ("guess", "s3cret"):
        r = login(password)
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert "too many wrong logins from 127.0.0.1" in r.json()["detail"]


def test_a_short_password_on_an_open_address_refuses_to_start():
    cmd = [sys.executable, "-m", "lmstack.cli", "webui", "--host", "0.0.0.0", "--port", "1", "--auth", "a:b"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--auth: the password of 'a' has 1 characters; on 0.0.0.0" in result.stderr
