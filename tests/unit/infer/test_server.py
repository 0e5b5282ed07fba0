"""API server rules that need no model: bind checks, the JSON 500 handler, request limits, the queue,
cancellation on disconnect and a free event loop. `FakeEngine` generates one "token" per tick and
checks its cancel event between tokens, as the real engine's stopping criteria do; apps run in a
real uvicorn on a loopback port, and clients disconnect by closing their socket."""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
from fastapi.testclient import TestClient

from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config
from lmstack.infer.limits import Limits, bind_socket, check_bind, is_loopback
from lmstack.infer.sampling import Generation, Piece, Sampling
from lmstack.infer.server import create_app, server_config

LONG_KEY = "k" * 16
LOCAL = "http://127.0.0.1"  # TestClient's own "testserver" is not a name a loopback server answers


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2", "[::1]"])
def test_loopback_hosts_need_no_key(host):
    assert is_loopback(host)
    check_bind(host, None)
    check_bind(host, "short")


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5", "example.com"])
def test_other_hosts_need_a_key_of_16_characters(host):
    assert not is_loopback(host)
    with pytest.raises(ConfigError, match=f"--host: {host} is reachable .* --api-key KEY or set API_KEY"):
        check_bind(host, None)
    with pytest.raises(ConfigError, match="--api-key: the key has 15 characters; .* at least 16") as err:
        check_bind(host, "k" * 15)
    assert "k" * 15 not in str(err.value)  # the key itself is never echoed
    check_bind(host, LONG_KEY)


@pytest.mark.parametrize(
    "limits, message",
    [
        (Limits(max_queue=-1), "--max-queue: got -1; give an integer of at least 0"),
        (Limits(max_prompt_tokens=0), "--max-prompt-tokens: got 0; give an integer of at least 1"),
        (Limits(max_tokens=0), "--max-tokens-limit: got 0; give an integer of at least 1"),
        (Limits(max_batch=0), "--max-batch: got 0; give an integer of at least 1"),
    ],
)
def test_limits_out_of_range_are_refused(limits, message):
    with pytest.raises(ConfigError, match=message):
        limits.check()
    Limits(max_queue=0, max_prompt_tokens=1, max_tokens=1).check()


class FakeEngine:
    """Prompt ids are the last message's characters; sequences run one at a time in arrival order
    (like `--max-batch 1`), each making one token per `tick` until max_tokens, its cancel event or
    `shutdown`. Records which prompts started / were cancelled. The engine interface of `submit`."""

    tool_format = "qwen"

    def __init__(self, max_new_tokens: int = 4, tick: float = 0.01, hold_tokenizer: bool = False):
        self.cfg = build_config(
            {"model_name_or_path": "m", "output_dir": "o", "max_new_tokens": max_new_tokens}
        )
        self.max_length = None
        self.tick = tick
        self.tokenizing = threading.Event()  # set when a prompt's tokenization starts
        self.tokenizer_free = threading.Event()  # tokenization waits for it (hold_tokenizer)
        if not hold_tokenizer:
            self.tokenizer_free.set()
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.tokenized = 0
        self.submitted: dict[str, threading.Event] = {}  # prompt -> its cancel event, as submitted
        self.jobs: queue.Queue = queue.Queue()
        self.shutdown = threading.Event()
        threading.Thread(target=self._work, daemon=True).start()

    def prompt_ids(self, messages, system=None, tools=None):
        self.tokenized += 1
        self.tokenizing.set()
        self.tokenizer_free.wait(60)  # a long encode (tokenizers release the GIL while encoding)
        return [ord(c) for c in messages[-1]["content"]]

    def text_ids(self, text, special=True):
        return [ord(c) for c in text]

    def sampling(self, max_new_tokens=None, **unused):
        return Sampling(max_tokens=max_new_tokens or self.cfg.generating.max_new_tokens)

    def submit(self, ids, sampling, sink, cancel):
        self.submitted["".join(map(chr, ids))] = cancel
        self.jobs.put((ids, sampling, sink, cancel))

    def _work(self):
        while True:
            ids, sampling, sink, cancel = self.jobs.get()
            label, n = "".join(map(chr, ids)), 0
            if cancel.is_set():  # left while waiting
                sink(Generation("", len(ids), 0, "stop"))
                continue
            try:
                self.run(label)
            except Exception as err:
                sink(err)
                continue
            self.started.append(label)
            while n < sampling.max_tokens and not cancel.is_set() and not self.shutdown.is_set():
                time.sleep(self.tick)
                n += 1
                sink(Piece("x"))
            if cancel.is_set():
                self.cancelled.append(label)
            sink(Generation("x" * n, len(ids), n, "length" if n == sampling.max_tokens else "stop"))

    def run(self, label):
        """Called as a sequence starts (BrokenEngine fails here)."""


@contextmanager
def serving(engine, *args, **kwargs):
    """The app in a real uvicorn on a free loopback port; yields the port."""
    import uvicorn

    sock = bind_socket("127.0.0.1", 0)
    app = create_app(engine, "m", *args, **kwargs)
    config = server_config(
        app, kwargs.get("limits", Limits()), log_level="warning", timeout_graceful_shutdown=2
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started)
    try:
        yield sock.getsockname()[1]
    finally:
        engine.shutdown.set()
        server.should_exit = True
        thread.join(10)


def wait_for(condition, timeout: float = 60.0) -> bool:
    """Polls `condition` until it holds; the timeout only guards against a hang."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def body(content: str, **fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **fields}


def open_request(port: int, payload: dict) -> socket.socket:
    """Sends a chat request on a raw socket (close it to disconnect)."""
    data = json.dumps(payload).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_disconnects_stops_its_generation(stream):
    engine = FakeEngine(max_new_tokens=100_000)  # 1000 s of generation unless cancelled
    with serving(engine) as port:
        client = open_request(port, body("long", stream=stream))
        assert wait_for(lambda: "long" in engine.started)
        client.close()
        assert wait_for(lambda: "long" in engine.cancelled), "generation went on without a client"
        # one sequence at a time: "next" is served only because "long" (1000 s of tokens) was stopped
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        reply = httpx.post(url, json=body("next", max_tokens=2), timeout=120)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("stream", [False, True])
def test_a_queued_client_that_disconnects_never_generates(stream):
    engine = FakeEngine(max_new_tokens=100_000)
    with serving(engine, limits=Limits(max_batch=1)) as port:
        first = open_request(port, body("first"))  # generates until its client leaves
        assert wait_for(lambda: "first" in engine.started)
        queued = open_request(port, body("queued", max_tokens=5, stream=stream))
        assert wait_for(lambda: "queued" in engine.submitted)
        queued.close()
        assert wait_for(lambda: engine.submitted["queued"].is_set()), "the server missed the disconnect"
        first.close()
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        assert httpx.post(url, json=body("third", max_tokens=2), timeout=120).status_code == 200
    assert engine.started == ["first", "third"]


def test_past_max_queue_a_request_gets_503_with_retry_after():
    engine = FakeEngine(max_new_tokens=100_000)
    with serving(engine, limits=Limits(max_queue=1, max_batch=1)) as port:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        first = open_request(port, body("first"))
        assert wait_for(lambda: "first" in engine.started)
        waiting = open_request(port, body("waiting"))
        assert wait_for(lambda: "waiting" in engine.submitted)
        reply = httpx.post(url, json=body("third", max_tokens=1))
        assert reply.status_code == 503
        assert int(reply.headers["Retry-After"]) >= 1
        error = reply.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "queue_full")
        assert (
            "at most 1 generate together and 1 wait (lmstack api --max-batch, --max-queue)"
            in error["message"]
        )
        waiting.close()  # both leave (the waiting one first): the queue is free again
        assert wait_for(lambda: engine.submitted["waiting"].is_set())
        first.close()
        assert wait_for(lambda: httpx.post(url, json=body("fourth", max_tokens=1)).status_code == 200)
    assert engine.started == ["first", "fourth"]


def test_the_event_loop_answers_while_prompts_are_tokenized():
    """Tokenization is held until /v1/models has answered: were it run on the event loop, that answer
    could not come (the request would time out) and the posts would fail."""
    engine = FakeEngine(hold_tokenizer=True)
    with serving(engine) as port:
        base = f"http://127.0.0.1:{port}/v1"
        replies: list[int] = []
        posts = [
            threading.Thread(
                target=lambda: replies.append(
                    httpx.post(f"{base}/chat/completions", json=body("hi"), timeout=60).status_code
                )
            )
            for _ in range(2)
        ]
        for thread in posts:
            thread.start()
        assert engine.tokenizing.wait(30)
        assert httpx.get(f"{base}/models", timeout=30).status_code == 200
        assert not engine.tokenizer_free.is_set() and engine.tokenized >= 1  # answered mid-tokenization
        engine.tokenizer_free.set()
        for thread in posts:
            thread.join()
    assert replies == [200, 200]


def post(client: TestClient, payload: dict) -> httpx.Response:
    return client.post("/v1/chat/completions", json=payload)


def test_max_tokens_is_bounded_by_the_limit_and_defaults_to_the_yaml():
    engine = FakeEngine(max_new_tokens=4, tick=0.001)
    client = TestClient(create_app(engine, "m", limits=Limits(max_tokens=50)), base_url=LOCAL)
    r = post(client, body("hi", max_tokens=51))
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "max_tokens: got 51; this server allows at most 50 (lmstack api --max-tokens-limit)"
    )
    assert r.json()["error"]["code"] == "max_tokens_exceeded"
    assert post(client, body("hi", max_tokens=50)).json()["usage"]["completion_tokens"] == 50
    assert post(client, body("hi")).json()["usage"]["completion_tokens"] == 4
    unset = TestClient(create_app(engine, "m"), base_url=LOCAL)
    r = unset.post("/v1/chat/completions", json=body("hi", max_tokens=5))
    assert r.status_code == 400 and "at most 4 (max_new_tokens in its YAML" in r.text  # no context known


def test_max_tokens_may_reach_the_models_context_unless_the_limit_is_lower():
    engine = FakeEngine(max_new_tokens=4, tick=0.0001)
    engine.max_length = 64  # the model's context
    client = TestClient(create_app(engine, "m"), base_url=LOCAL)
    assert post(client, body("hi", max_tokens=60)).json()["usage"]["completion_tokens"] == 60
    r = post(client, body("hi", max_tokens=65))
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "max_tokens: got 65; this server allows at most 64 (the model's context; the prompt's tokens "
        "count against it too)"
    )
    r = post(client, body("hi", max_tokens=63))  # 2 prompt tokens + 63 > 64
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "messages: the prompt has 2 tokens; with max_tokens 63 it exceeds the model's 64-token context"
    )
    limited = TestClient(create_app(engine, "m", limits=Limits(max_tokens=10)), base_url=LOCAL)
    assert "at most 10 (lmstack api --max-tokens-limit)" in post(limited, body("hi", max_tokens=11)).text


def test_prompt_size_is_bounded_before_and_after_tokenizing():
    engine = FakeEngine(tick=0.001)  # one token per character
    client = TestClient(create_app(engine, "m", limits=Limits(max_prompt_tokens=10)), base_url=LOCAL)
    r = post(client, body("x" * 321))
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "messages: the prompt has 321 characters; this server allows at most 10 tokens "
        "(lmstack api --max-prompt-tokens), so at most 320 characters"
    )
    assert engine.tokenized == 0  # refused before tokenizing
    r = post(client, body("x" * 11))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["message"] == (
        "messages: the prompt has 11 tokens; this server allows at most 10 (lmstack api --max-prompt-tokens)"
    )
    assert post(client, body("x" * 10)).status_code == 200


@pytest.mark.parametrize("raw", [b"[" * 100_000, b'{"a":' * 100_000])
def test_deeply_nested_json_is_a_400(raw):
    client = TestClient(create_app(FakeEngine(), "m"), base_url=LOCAL, raise_server_exceptions=False)
    r = client.post("/v1/chat/completions", content=raw)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "request body is not valid JSON: nested too deeply"


class BrokenEngine(FakeEngine):
    """An engine whose generation fails unexpectedly (a bug, an OOM)."""

    def run(self, label):
        raise RuntimeError("CUDA out of memory (secret detail)")


def test_unexpected_failures_are_a_json_500_without_traceback():
    app = create_app(BrokenEngine(), "m", LONG_KEY)
    client = TestClient(app, base_url=LOCAL, raise_server_exceptions=False)
    r = client.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {LONG_KEY}"},
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
    app = create_app(BrokenEngine(), "m", LONG_KEY)
    client = TestClient(app, base_url=LOCAL, raise_server_exceptions=False)
    payload = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    r = client.post("/v1/chat/completions", json=payload, headers={"Authorization": f"Bearer {LONG_KEY}"})
    events = [e for e in r.text.split("\n\n") if e]
    assert r.status_code == 200
    assert json.loads(events[0][6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[1:] == [
        'data: {"error": {"message": "generation failed (RuntimeError)", "type": "server_error"}}',
        "data: [DONE]",
    ]
    assert "secret" not in r.text
