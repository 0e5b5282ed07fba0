"""OpenAI-compatible HTTP API: `GET /v1/models`, `POST /v1/chat/completions` (plain and SSE).

Safety: an API key (Bearer) is compared in constant time; binding a non-loopback address needs one of
at least `MIN_KEY_CHARS` characters (`check_bind`). Every request is bounded (`Limits`, flags of
`lmstack api`): the body by `MAX_BODY_BYTES` before it is parsed (413); the prompt by
`--max-prompt-tokens`, counted in characters before tokenizing (`CHARS_PER_TOKEN` per allowed token)
and in tokens after (400); `max_tokens` by `--max-tokens-limit` (400); the requests admitted behind
the one generating by `--max-queue` (503 with `Retry-After`). Tokenization and generation run in
worker threads, so the event loop keeps answering while big prompts are tokenized. A client that
disconnects (waiting, tokenizing or generating, streamed or not) leaves the queue, and its
generation stops at the next token. One generation runs at a time, in arrival order. Malformed
requests get a 4xx JSON error (`{"error": {"message", "type", "param", "code"}}`), unexpected
failures a JSON 500 without a traceback. Model settings such as `trust_remote_code` come only from
the YAML, never from a request.

Request fields the server does not use (`user`, `seed`, `presence_penalty`, ...) are accepted and
ignored, as OpenAI clients send them freely; `n > 1` and `tools` are refused with a 400. `stop`
strings end the reply before the first of them (also when streaming: text that could start a stop
string is held back until it cannot).
"""

import functools
import hmac
import ipaddress
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from lmstack.config.errors import ConfigError, LmstackError
from lmstack.infer.admission import Gate, event_stream, until_disconnect
from lmstack.infer.openai_request import (
    APIError,
    ChatRequest,
    check_prompt_chars,
    check_prompt_tokens,
    check_request,
    to_conversation,
    validation_message,
)

logger = logging.getLogger(__name__)
MAX_BODY_BYTES = 1 << 20
MIN_KEY_CHARS = 16


@dataclass(frozen=True)
class Limits:
    """Bounds of one server (`lmstack api` flags). `max_tokens` None: the YAML's `max_new_tokens`
    (which is also the default of a request's max_tokens)."""

    max_queue: int = 16  # requests admitted while one generates; one more gets a 503
    max_prompt_tokens: int = 8192
    max_tokens: int | None = None

    def check(self) -> None:
        for flag, value, low in (
            ("--max-queue", self.max_queue, 0),
            ("--max-prompt-tokens", self.max_prompt_tokens, 1),
            ("--max-tokens-limit", self.max_tokens, 1),
        ):
            if value is not None and value < low:
                raise ConfigError(f"{flag}: got {value}; give an integer of at least {low}")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None) -> None:
    if is_loopback(host):
        return
    if not api_key:
        raise ConfigError(
            f"--host: {host} is reachable from other machines, so an API key is required; pass "
            "--api-key KEY or set API_KEY (clients send `Authorization: Bearer KEY`), or bind 127.0.0.1"
        )
    if len(api_key) < MIN_KEY_CHARS:
        raise ConfigError(
            f"--api-key: the key has {len(api_key)} characters; on {host}, reachable from other machines, "
            f"it needs at least {MIN_KEY_CHARS} (make one with: python -c 'import secrets; "
            "print(secrets.token_urlsafe(24))'), or bind 127.0.0.1"
        )


async def _read_json(request: Any) -> Any:
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise APIError(413, f"request body too large: {length} bytes; the limit is {MAX_BODY_BYTES}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise APIError(413, f"request body too large; the limit is {MAX_BODY_BYTES} bytes")
    try:
        return json.loads(body)
    except ValueError as err:
        raise APIError(400, f"request body is not valid JSON: {err}") from None
    except RecursionError:
        raise APIError(400, "request body is not valid JSON: nested too deeply") from None


def _error(status: int, message: str, kind: str, param: str | None = None, **extra: Any) -> Any:
    from fastapi.responses import JSONResponse

    headers = extra.get("headers") or ({"WWW-Authenticate": "Bearer"} if status == 401 else None)
    body = {"error": {"message": message, "type": kind, "param": param, "code": extra.get("code")}}
    return JSONResponse(body, status_code=status, headers=headers)


def _install_error_handlers(app: Any) -> None:
    """Every error is OpenAI's JSON shape; unexpected ones are a 500 without a traceback."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    async def api_error(request: Any, exc: APIError) -> Any:
        return _error(exc.status, exc.message, exc.kind, exc.param, code=exc.code, headers=exc.headers)

    async def http_error(request: Any, exc: HTTPException) -> Any:
        return _error(exc.status_code, str(exc.detail), "invalid_request_error")

    async def validation_error(request: Any, exc: RequestValidationError) -> Any:
        return _error(422, str(exc.errors()), "invalid_request_error")

    async def internal_error(request: Any, exc: Exception) -> Any:
        logger.error("request failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
        return _error(500, f"internal error ({type(exc).__name__}); see the server log", "server_error")

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, internal_error)


def _authorize(request: Any, api_key: str | None) -> None:
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(
            401, "invalid or missing API key (send Authorization: Bearer KEY)", "authentication_error"
        )


def _parse(body: Any, engine: Any, limits: Limits) -> tuple[ChatRequest, str | None, list[dict], dict]:
    """A validated request -> (request, system, conversation, generation overrides)."""
    try:
        req = ChatRequest.model_validate(body)
    except ValidationError as err:
        raise APIError(422, validation_message(err)) from None
    default = engine.cfg.generating.max_new_tokens
    if limits.max_tokens is None:
        cap, source = default, "max_new_tokens in its YAML; lmstack api --max-tokens-limit raises it"
    else:
        cap, source = limits.max_tokens, "lmstack api --max-tokens-limit"
    max_tokens = check_request(req, default, cap, source)
    system, conv = to_conversation(req)
    check_prompt_chars(system, conv, limits.max_prompt_tokens)
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    params = {"max_new_tokens": max_tokens, "temperature": req.temperature, "top_p": req.top_p, "stop": stop}
    return req, system, conv, params


def create_app(engine: Any, model_name: str, api_key: str | None = None, limits: Limits = Limits()) -> Any:
    import anyio
    from fastapi import FastAPI, Request, Response

    app = FastAPI(title="lmstack api", docs_url=None, redoc_url=None, openapi_url=None)
    _install_error_handlers(app)
    created = int(time.time())
    gate = Gate(limits.max_queue)
    tokenizing = anyio.CapacityLimiter(1)

    def tokenize(conv: list[dict], system: str | None, max_tokens: int) -> list[int]:
        try:
            ids = engine.prompt_ids(conv, system)
        except (ValueError, LmstackError) as err:
            raise APIError(400, f"messages: {err}", param="messages") from None
        check_prompt_tokens(len(ids), max_tokens, limits.max_prompt_tokens, engine.max_length)
        return ids

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict:
        _authorize(request, api_key)
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "lmstack"}],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        _authorize(request, api_key)
        req, system, conv, params = _parse(await _read_json(request), engine, limits)
        release, gone, reply_id = gate.admit(), threading.Event(), f"chatcmpl-{uuid.uuid4().hex}"
        if release is None:
            raise _busy(gate)
        try:
            async with until_disconnect(request.receive, gone):
                work = functools.partial(tokenize, conv, system, params["max_new_tokens"])
                ids = await anyio.to_thread.run_sync(work, limiter=tokenizing)
                if req.stream:
                    usage = bool((req.stream_options or {}).get("include_usage"))
                    events = _events(engine, gate, ids, params, gone, (reply_id, model_name, usage))
                    response, release = event_stream(events, gone, release), lambda: None
                    return response  # which releases the admission when it ends
                async with gate.generating():
                    work = functools.partial(engine.generate_ids, ids, gone, **params)
                    result = await anyio.to_thread.run_sync(work)
                return _completion(result, reply_id, model_name)
        finally:
            release()
        logger.info("client disconnected: request %s dropped", reply_id)
        return Response(status_code=499)  # nobody reads it

    return app


def _busy(gate: Gate) -> APIError:
    wait = gate.retry_after
    return APIError(
        503,
        f"server busy: {gate.admitted} requests in progress, at most {gate.max_queue} may wait behind the "
        f"one generating (lmstack api --max-queue); retry after {wait} s",
        "server_error",
        code="queue_full",
        headers={"Retry-After": str(wait)},
    )


def _completion(result: Any, reply_id: str, model: str) -> dict:
    return {
        "id": reply_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": result.text},
                "finish_reason": result.finish_reason,
            }
        ],
        "usage": _usage(result),
    }


def _usage(result: Any) -> dict:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


async def _events(
    engine: Any, gate: Gate, ids: list[int], params: dict, gone: threading.Event, reply: tuple
) -> AsyncIterator[str]:
    """Server-sent events: role chunk, content chunks, finish chunk, [usage chunk], [DONE]."""
    import anyio

    reply_id, model, usage = reply

    def chunk(choices: list, **extra: Any) -> str:
        body = {
            "id": reply_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            **extra,
        }
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def delta(content: dict, finish: str | None = None) -> str:
        return chunk([{"index": 0, "delta": content, "finish_reason": finish}])

    try:
        async with gate.generating():
            work = functools.partial(engine.stream_ids, ids, gone, **params)
            stream = await anyio.to_thread.run_sync(work)
            try:
                pieces = iter(stream)
                yield delta({"role": "assistant", "content": ""})
                while (piece := await anyio.to_thread.run_sync(next, pieces, None)) is not None:
                    yield delta({"content": piece})
            finally:  # the generation ends before the next one may start
                stream.close()
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(stream.thread.join)
        result = stream.result
        yield delta({}, result.finish_reason)
        if usage:
            yield chunk([], usage=_usage(result))
    except Exception as exc:  # the response has started: report in-band
        logger.error("stream failed: %s", exc, exc_info=exc)
        failed = {"error": {"message": f"generation failed ({type(exc).__name__})", "type": "server_error"}}
        yield f"data: {json.dumps(failed)}\n\n"
    yield "data: [DONE]\n\n"


def bind_socket(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as err:
        raise ConfigError(
            f"--host/--port: cannot listen on {host}:{port} ({err}); try --port 0 for any free port"
        ) from None
    sock.listen(128)
    return sock


def serve(
    engine: Any, host: str, port: int, api_key: str | None, model_name: str, limits: Limits = Limits()
) -> None:
    """Bind first (so port 0 resolves), print the real URL, then run uvicorn on that socket."""
    import uvicorn

    check_bind(host, api_key)
    sock = bind_socket(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    print(f"lmstack api: serving {model_name!r} at http://{shown}:{bound_port}/v1", flush=True)
    app = create_app(engine, model_name, api_key, limits)
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", access_log=True))
    server.run(sockets=[sock])
