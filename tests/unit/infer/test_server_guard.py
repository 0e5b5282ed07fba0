"""What `lmstack api` refuses before it reads a request, in a real uvicorn on loopback: Host / Origin
names (DNS rebinding, cross-site pages), non-JSON bodies, guessed keys, slow headers and bodies, a
stream nobody reads, one request's work, and image decompression bombs. Every wait is on an event
(a closed socket, a reply, the engine's record), never on a clock."""

from __future__ import annotations

import base64
import json
import socket

import httpx
import pytest
from fastapi.testclient import TestClient
from tests.unit.infer.test_server import LOCAL, LONG_KEY, FakeEngine, body, serving, wait_for
from tests.unit.infer.test_server_lf import TextEngine

from lmstack.infer.guard import HostPolicy, Throttle
from lmstack.infer.limits import Limits
from lmstack.infer.server import create_app


def chat(port: int, headers: dict | None = None, **kwargs) -> httpx.Response:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    return httpx.post(url, headers=headers or {}, timeout=30, **kwargs)


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:8000", "0.0.0.0:8000", "10.0.0.5"])
def test_a_host_that_is_not_this_servers_name_is_refused(host):
    engine = FakeEngine(tick=0.0001)
    with serving(engine) as port:
        r = chat(port, {"Host": host}, json=body("hi"))
        assert r.status_code == 403, r.text
        message = r.json()["error"]["message"]
        assert message.startswith(f"Host: {host!r} is not a name of this server (a web page may be")
        assert "--allow-host NAME (or API_ALLOWED_HOSTS" in message
        get = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Host": host})
        assert get.status_code == 403
    assert engine.tokenized == 0


@pytest.mark.parametrize(
    "host", ["localhost", "localhost:8000", "127.0.0.1:9", "127.0.0.2", "[::1]:80", "LOCALHOST"]
)
def test_loopback_names_are_answered(host):
    with serving(FakeEngine(tick=0.0001)) as port:
        assert chat(port, {"Host": host}, json=body("hi")).status_code == 200


def test_allowed_hosts_and_a_wildcard_bind():
    limits = Limits(allowed_hosts=("api.lan",))
    with serving(FakeEngine(tick=0.0001), limits=limits) as port:
        assert chat(port, {"Host": "api.lan:8000"}, json=body("hi")).status_code == 200
        assert chat(port, {"Origin": "http://api.lan:3000"}, json=body("hi")).status_code == 200
        assert chat(port, {"Host": "other.lan"}, json=body("hi")).status_code == 403
    # bound to every address (a key is required there): any Host, but a foreign Origin is refused
    with serving(FakeEngine(tick=0.0001), LONG_KEY, bound="0.0.0.0") as port:
        auth = {"Authorization": f"Bearer {LONG_KEY}"}
        assert chat(port, {**auth, "Host": "gpu-box.lan"}, json=body("hi")).status_code == 200
        assert chat(port, {**auth, "Origin": "https://evil.example"}, json=body("hi")).status_code == 403
    assert HostPolicy("127.0.0.1", ("*",)).problem("GET", {"host": "any.example"}) is None


@pytest.mark.parametrize("origin", ["https://evil.example", "null", "http://localhost.evil.example"])
def test_a_cross_site_origin_is_refused(origin):
    engine = FakeEngine(tick=0.0001)
    with serving(engine) as port:
        r = chat(port, {"Origin": origin}, json=body("hi"))
        assert r.status_code == 403
        assert r.json()["error"]["message"].startswith(
            f"Origin: {origin!r}: a web page on another site may not call this server"
        )
        assert chat(port, {"Origin": "http://localhost:3000"}, json=body("hi")).status_code == 200
    assert engine.tokenized == 1


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ],
)
def test_a_body_a_browser_sends_without_preflight_is_refused_and_never_generates(content_type):
    """A page on any site may POST these types without asking (no CORS preflight); were the body parsed
    as JSON, the page could start generations on a keyless loopback server."""
    engine = FakeEngine(tick=0.0001)
    with serving(engine) as port:
        r = chat(port, {"Content-Type": content_type}, content=json.dumps(body("hi")).encode())
        assert r.status_code == 415
        assert r.json()["error"]["message"] == (
            f"Content-Type: {content_type!r}; send the body as JSON with Content-Type: application/json "
            "(other types are what a web page on another site can send without asking first)"
        )
        ok = chat(port, {"Content-Type": "application/json; charset=utf-8"}, content=json.dumps(body("ok")))
        assert ok.status_code == 200
        bare = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions", content=json.dumps(body("bare")).encode()
        )
        assert bare.status_code == 200  # no Content-Type is read as JSON, as FastAPI does
    assert engine.tokenized == 2


def test_wrong_keys_are_throttled_per_address():
    throttle = Throttle(attempts=3, window=3600.0)
    with serving(FakeEngine(tick=0.0001), LONG_KEY, throttle=throttle) as port:
        for _ in range(3):
            assert chat(port, {"Authorization": "Bearer wrong"}, json=body("hi")).status_code == 401
        for key in ("wrong", LONG_KEY):  # locked out: the right key waits too
            r = chat(port, {"Authorization": f"Bearer {key}"}, json=body("hi"))
            assert r.status_code == 429
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["message"].startswith(
                "too many wrong API keys from 127.0.0.1: 3 in 3600 s"
            )


def test_the_throttle_forgets_after_its_window():
    now = [0.0]
    throttle = Throttle(attempts=2, window=60.0, clock=lambda: now[0])
    throttle.failed("a")
    throttle.failed("a")
    assert throttle.locked("a") == 60 and throttle.locked("b") is None
    now[0] = 59.5
    assert throttle.locked("a") == 1
    now[0] = 60.0
    assert throttle.locked("a") is None
    throttle.failed("a")
    assert throttle.locked("a") is None  # one failure in the new window


def closed_by_server(sock: socket.socket) -> bool:
    """True when the server closes `sock` (recv gives EOF) before the socket's own timeout."""
    sock.settimeout(60)
    try:
        while chunk := sock.recv(4096):
            if b"HTTP/1.1 408" in chunk:
                return True
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_a_connection_that_never_finishes_its_headers_is_closed():
    with serving(FakeEngine(tick=0.0001), limits=Limits(read_timeout=0.2)) as port:
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: ")  # and no more
        assert closed_by_server(slow)
        slow.close()
        # a kept-alive connection gets the same deadline for its next request's headers
        kept = socket.create_connection(("127.0.0.1", port))
        kept.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert kept.recv(4096).startswith(b"HTTP/1.1 200")
        kept.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 1")
        assert closed_by_server(kept)
        kept.close()
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 200


def test_a_body_that_never_arrives_is_a_408():
    engine = FakeEngine(tick=0.0001)
    with serving(engine, limits=Limits(read_timeout=0.2)) as port:
        sock = socket.create_connection(("127.0.0.1", port))
        head = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        sock.sendall(f'{head}Content-Length: 100\r\n\r\n{{"model": '.encode())
        sock.settimeout(60)
        reply = sock.recv(65536)
        sock.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert b"request body not received within 0.2 s (lmstack api --read-timeout)" in reply
    assert engine.tokenized == 0


def test_a_stream_whose_client_stops_reading_is_dropped_and_frees_its_place():
    """The client reads nothing: once the socket buffers fill, the server's writes wait; after
    --stall-timeout the stream is dropped, its generation cancelled and its batch place given back."""
    engine = FakeEngine(max_new_tokens=10**8, tick=0)
    limits = Limits(max_batch=1, max_queue=0, stall_timeout=0.5, max_request_tokens=10**9)
    with serving(engine, limits=limits) as port:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        data = json.dumps(body("stalled", stream=True)).encode()
        head = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
        assert wait_for(lambda: "stalled" in engine.cancelled, timeout=120), "a stalled stream kept its place"
        r = chat(port, json=body("next", max_tokens=2))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        sock.close()


def completions(client: TestClient, **fields) -> httpx.Response:
    return client.post("/v1/completions", json={"model": "m", **fields})


def test_one_requests_work_is_bounded_and_named():
    engine = TextEngine(max_new_tokens=4, tick=0.0001)
    engine.max_length = 64
    app = create_app(engine, "m", limits=Limits(max_batch=8, max_request_tokens=100))
    client = TestClient(app, base_url=LOCAL)
    r = completions(client, prompt=["a", "b", "c"], n=3)
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "prompts x n: 3 x 3 = 9 sequences; this server generates at most 8 per request (lmstack api "
        "--max-batch): send fewer prompts or a smaller n"
    )
    r = client.post("/v1/chat/completions", json=body("hi", n=4, max_tokens=30))
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "prompts x n x max_tokens: 1 x 4 x 30 = 120 tokens to generate; this server allows at most 100 "
        "per request (lmstack api --max-request-tokens)"
    )
    assert engine.tokenized == 0
    assert completions(client, prompt=["a", "b"], n=2, max_tokens=25).status_code == 200  # 100 tokens


def png(width: int, height: int) -> str:
    """A data URL of a grey PNG that declares width x height: its header, a few rows of pixel data,
    then the end (a bomb is such a header over highly compressible rows; the size is read first)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = zlib.compress(b"\0" * (width + 1) * min(height, 4))
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    raw = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(raw).decode()


@pytest.mark.parametrize("side", [9000, 20000])
def test_an_image_with_too_many_pixels_is_refused_before_it_is_decoded(side):
    from lmstack.infer.vision import MAX_IMAGE_PIXELS, open_image

    url = png(side, side)
    assert len(url) < 1 << 20  # fits in one request body
    with pytest.raises(ValueError) as err:
        open_image(url)
    if side * side <= 2 * 89_478_485:  # under PIL's own bomb bound: ours names the size
        assert str(err.value) == (
            f"image_url: {side} x {side} = {side * side} pixels; lmstack decodes at most "
            f"{MAX_IMAGE_PIXELS} pixels per image: send a smaller image"
        )
    else:
        assert "more pixels than lmstack decodes" in str(err.value)
    assert open_image(png(64, 4)).size == (64, 4)
