"""OpenAI-compatible HTTP API: `GET /v1/models`, `POST /v1/chat/completions` (plain and SSE).

Safety: an API key (Bearer) is compared in constant time; it is required to bind a non-loopback
address (`check_bind`). Request bodies are capped at `MAX_BODY_BYTES` (413), `max_tokens` at the
YAML's `max_new_tokens` (400); malformed requests get a 4xx JSON error
(`{"error": {"message", "type", "param", "code"}}`), and unexpected failures a JSON 500 without a
traceback. One generation runs at a time (the engine's lock). Model settings such as
`trust_remote_code` come only from the YAML, never from a request.

Request fields the server does not use (`user`, `seed`, `presence_penalty`, ...) are accepted and
ignored, as OpenAI clients send them freely; `n > 1` and `tools` are refused with a 400. `stop`
strings end the reply before the first of them (also when streaming: text that could start a stop
string is held back until it cannot).
"""

import hmac
import ipaddress
import json
import logging
import socket
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lmstack.config.errors import ConfigError, LmstackError

logger = logging.getLogger(__name__)
MAX_BODY_BYTES = 1 << 20


class APIError(Exception):
    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[Any] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    messages: list[Message] = Field(min_length=1)
    stream: bool = False
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    tools: list[Any] | None = None
    stream_options: dict[str, Any] | None = None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None) -> None:
    if not is_loopback(host) and not api_key:
        raise ConfigError(
            f"--host: {host} is reachable from other machines, so an API key is required; pass "
            "--api-key KEY or set API_KEY (clients send `Authorization: Bearer KEY`), or bind 127.0.0.1"
        )


def to_conversation(req: ChatRequest) -> tuple[str | None, list[dict]]:
    """OpenAI messages -> (system, lmstack messages); 400 on what the template cannot render."""
    messages = list(req.messages)
    system = None
    if messages[0].role in ("system", "developer"):
        system = messages.pop(0).text()
    conv = []
    for i, m in enumerate(messages):
        if m.role in ("system", "developer"):
            raise APIError(400, f"messages[{i}]: a system message is only allowed first", param="messages")
        if m.tool_calls:
            raise APIError(400, f"messages[{i}]: tool calls are not supported", param="messages")
        conv.append({"role": "observation" if m.role == "tool" else m.role, "content": m.text()})
    if not conv or conv[-1]["role"] not in ("user", "observation"):
        raise APIError(
            400, "messages: the last message must come from the user (or a tool)", param="messages"
        )
    from lmstack.templates.template import check_roles

    try:
        check_roles(conv)
    except ValueError as err:
        raise APIError(400, f"messages: {err}", param="messages") from None
    return system, conv


def _check_request(req: ChatRequest, cap: int) -> int:
    if req.n != 1:
        raise APIError(400, f"n: got {req.n}; only n=1 is supported", param="n")
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    if len(stops) > 4 or not all(0 < len(s) <= 256 for s in stops):
        raise APIError(400, "stop: give up to 4 non-empty strings of at most 256 characters", param="stop")
    if req.tools:
        raise APIError(400, "tools: tool calling is not supported by lmstack api yet", param="tools")
    wanted = req.max_completion_tokens or req.max_tokens or cap
    if wanted > cap:
        raise APIError(
            400,
            f"max_tokens: got {wanted}; this server allows at most {cap} (max_new_tokens in its YAML)",
            param="max_tokens",
        )
    return wanted


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


def _validation_message(err: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in err.errors())


def _error(status: int, message: str, kind: str, param: str | None = None) -> Any:
    from fastapi.responses import JSONResponse

    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


def _install_error_handlers(app: Any) -> None:
    """Every error is OpenAI's JSON shape; unexpected ones are a 500 without a traceback."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    async def api_error(request: Any, exc: APIError) -> Any:
        return _error(exc.status, exc.message, exc.kind, exc.param)

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


async def _parse(request: Any, engine: Any) -> tuple[ChatRequest, str | None, list[dict], dict]:
    """A validated request -> (request, system, conversation, generation overrides)."""
    try:
        req = ChatRequest.model_validate(await _read_json(request))
    except ValidationError as err:
        raise APIError(422, _validation_message(err)) from None
    max_tokens = _check_request(req, engine.cfg.generating.max_new_tokens)
    system, conv = to_conversation(req)
    try:
        prompt_len = len(engine.prompt_ids(conv, system))
    except (ValueError, LmstackError) as err:
        raise APIError(400, f"messages: {err}", param="messages") from None
    limit = engine.max_length
    if limit and prompt_len + max_tokens > limit:
        raise APIError(
            400,
            f"messages: the prompt has {prompt_len} tokens; with max_tokens {max_tokens} it exceeds "
            f"the model's {limit}-token context",
            param="messages",
        )
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    params = {"max_new_tokens": max_tokens, "temperature": req.temperature, "top_p": req.top_p, "stop": stop}
    return req, system, conv, params


def create_app(engine: Any, model_name: str, api_key: str | None = None) -> Any:
    import anyio
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    app = FastAPI(title="lmstack api", docs_url=None, redoc_url=None, openapi_url=None)
    _install_error_handlers(app)
    created = int(time.time())

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
        req, system, conv, params = await _parse(request, engine)
        reply_id = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            usage = bool((req.stream_options or {}).get("include_usage"))
            events = _sse(engine, conv, system, params, reply_id, model_name, usage)
            return StreamingResponse(events, media_type="text/event-stream")
        result = await anyio.to_thread.run_sync(lambda: engine.generate(conv, system, **params))
        choice = {"role": "assistant", "content": result.text}
        return {
            "id": reply_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": [{"index": 0, "message": choice, "finish_reason": result.finish_reason}],
            "usage": _usage(result),
        }

    return app


def _usage(result: Any) -> dict:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


async def _sse(
    engine: Any, conv: list, system: str | None, params: dict, reply_id: str, model: str, usage: bool
):
    """Server-sent events: role chunk, content chunks, finish chunk, [usage chunk], [DONE]."""
    import anyio

    def chunk(delta: dict, finish: str | None = None, **extra: Any) -> str:
        body = {
            "id": reply_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            **extra,
        }
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    stream = None
    try:
        stream = await anyio.to_thread.run_sync(lambda: engine.stream(conv, system, **params))
        pieces = iter(stream)
        yield chunk({"role": "assistant", "content": ""})
        while (piece := await anyio.to_thread.run_sync(next, pieces, None)) is not None:
            yield chunk({"content": piece})
        result = stream.result
        yield chunk({}, result.finish_reason)
        if usage:
            body = {
                "id": reply_id,
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": model,
                "choices": [],
                "usage": _usage(result),
            }
            yield f"data: {json.dumps(body)}\n\n"
    except Exception as exc:  # the response has started: report in-band
        logger.error("stream failed: %s", exc, exc_info=exc)
        failed = {"error": {"message": f"generation failed ({type(exc).__name__})", "type": "server_error"}}
        yield f"data: {json.dumps(failed)}\n\n"
    finally:
        if stream is not None:
            stream.close()
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


def serve(engine: Any, host: str, port: int, api_key: str | None, model_name: str) -> None:
    """Bind first (so port 0 resolves), print the real URL, then run uvicorn on that socket."""
    import uvicorn

    check_bind(host, api_key)
    sock = bind_socket(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    print(f"lmstack api: serving {model_name!r} at http://{shown}:{bound_port}/v1", flush=True)
    app = create_app(engine, model_name, api_key)
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", access_log=True))
    server.run(sockets=[sock])
