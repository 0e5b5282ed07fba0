"""OpenAI-compatible HTTP API: `GET /v1/models`, `POST /v1/chat/completions` and
`POST /v1/completions` (plain and SSE), served by any backend with the engine interface
(`submit(ids, sampling, sink, cancel)`, `prompt_ids`, `text_ids`, `sampling`, `cfg`, `max_length`,
`tool_format`): the transformers backend batches concurrent requests continuously
(`infer/batching.py`); vLLM / SGLang do their own (`infer/engines.py`).

Safety: an API key (Bearer) is compared in constant time, and an address that sends wrong keys too
often waits (429); binding a non-loopback address needs a key of at least `MIN_KEY_CHARS` characters
(`check_bind`). Host and Origin must name this server and a POST body must be JSON, against DNS
rebinding and cross-site pages (`infer/guard.py`, `--allow-host`). Slow clients are bounded: headers
and body by `--read-timeout` (the connection closed / 408), a stream's writes by `--stall-timeout`
(the stream dropped, its batch place freed). Every request is bounded (`Limits`, flags of
`lmstack api`): the body by `MAX_BODY_BYTES` before it is parsed (413); the prompt by
`--max-prompt-tokens`, counted in characters before tokenizing (`CHARS_PER_TOKEN` per allowed token)
and in tokens after (400); `max_tokens` by the model's context or a lower `--max-tokens-limit` (400,
naming it; never capped silently); its work by prompts x n <= `--max-batch` and prompts x n x
max_tokens <= `--max-request-tokens` (400); images by `vision.MAX_IMAGE_PIXELS` before decoding; the
requests in progress by `--max-batch` + `--max-queue` (503 with `Retry-After`).
Tokenization runs in worker threads, so the event loop keeps answering while big prompts are
tokenized. A client that disconnects (waiting, tokenizing or generating, streamed or not) leaves the
queue, and its generation stops at the next token. One model is served, so any `model` name is
accepted and echoed in the reply, as LLaMA-Factory's API does (clients send "gpt-4o" and the like).
Malformed requests get a 4xx JSON error (`{"error": {"message", "type", "param", "code"}}`),
unexpected failures a JSON 500 without a traceback. Model settings such as `trust_remote_code`
come only from the YAML, never from a request.

Request features: `n`, `seed` (choice i samples with seed + i), `stop` (the text ends before it),
`logprobs`/`top_logprobs` (log_softmax of the model's logits), `response_format: json_object`
(constrained decoding, `infer/json_mode.py`), `tools` with `tool_choice` auto | none | a named
function | required (with one tool, that one is named; with more it is refused by name) (the calls
are read back in the template's tool format, `infer/toolcalls.py`; a named function is forced: its
call's prefix is written and the arguments are decoded as a JSON object),
`presence_penalty`, `frequency_penalty`, `logit_bias`, and vLLM's `top_k` / `repetition_penalty`.
With tools, a streamed reply comes in one piece when it ends (it may turn out to be a call).
Images: on a Qwen2-VL / Qwen2.5-VL / LLaVA model (transformers backend), user messages may carry
`image_url` parts (a data: URL, or file:///abs/path or /abs/path inside a folder given with
`--image-dir`; no network), built into the prompt as training builds it (`infer/vision.py`); such requests run outside
the batcher, one at a time, with one choice and plain sampling, and stream as one chunk.
Fields it cannot honour are refused by name (`openai_request.py`); `user` and the like are accepted.
"""

import functools
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pydantic import ValidationError

from lmstack.config.errors import LmstackError
from lmstack.infer.admission import Gate, event_stream, until_disconnect
from lmstack.infer.guard import Guard, HostPolicy, Throttle, deadline_protocol
from lmstack.infer.limits import Limits, bind_socket, check_bind, readable_file
from lmstack.infer.openai_request import (
    APIError,
    ChatRequest,
    CompletionRequest,
    check_completion,
    check_image_request,
    check_prompt_chars,
    check_prompt_tokens,
    check_request,
    check_work,
    image_urls,
    to_conversation,
    tool_choice,
    validation_message,
)
from lmstack.infer.replies import Reply
from lmstack.infer.runs import Runs
from lmstack.infer.sampling import Sampling

logger = logging.getLogger(__name__)
MAX_BODY_BYTES = 1 << 20


async def _read_json(request: Any, seconds: float) -> Any:
    import anyio

    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise APIError(413, f"request body too large: {length} bytes; the limit is {MAX_BODY_BYTES}")
    body = bytearray()
    with anyio.move_on_after(seconds) as reading:
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise APIError(413, f"request body too large; the limit is {MAX_BODY_BYTES} bytes")
    if reading.cancelled_caught:
        raise APIError(408, f"request body not received within {seconds:g} s (lmstack api --read-timeout)")
    try:
        parsed = json.loads(body)
        json.dumps(parsed, ensure_ascii=False).encode("utf-8")  # a lone surrogate ("\ud800") fails here
        return parsed
    except UnicodeEncodeError as err:
        bad = err.object[err.start : err.end].encode("unicode_escape").decode()
        raise APIError(
            400, f"request body: a string holds {bad}, a lone surrogate; send valid Unicode"
        ) from None
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


def _authorize(request: Any, api_key: str | None, throttle: Throttle) -> None:
    """The Bearer key compared in constant time; an address that failed too often waits (429)."""
    if api_key is None:
        return
    who = request.client.host if request.client else ""
    wait = throttle.locked(who)
    if wait is not None:
        raise APIError(
            429,
            f"too many wrong API keys from {who}: {throttle.attempts} in {throttle.window:g} s; retry after "
            f"{wait} s",
            "authentication_error",
            code="too_many_failed_keys",
            headers={"Retry-After": str(wait)},
        )
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        throttle.failed(who)
        raise APIError(
            401, "invalid or missing API key (send Authorization: Bearer KEY)", "authentication_error"
        )


def _validate(model: type, body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise APIError(422, validation_message(err)) from None


def _cap(engine: Any, limits: Limits) -> tuple[int, int, str]:
    """(the default max_tokens, the largest a request may ask, where that bound comes from): the
    YAML's max_new_tokens is the default; a request may ask up to the model's context, as with
    LLaMA-Factory's API (which passes max_tokens on unbounded), unless --max-tokens-limit is lower."""
    default, context = engine.cfg.generating.max_new_tokens, engine.max_length
    if limits.max_tokens is not None and (context is None or limits.max_tokens < context):
        return default, limits.max_tokens, "lmstack api --max-tokens-limit"
    if context is None:
        return default, default, "max_new_tokens in its YAML; lmstack api --max-tokens-limit raises it"
    return default, context, "the model's context; the prompt's tokens count against it too"


def _samplings(engine: Any, req: Any, max_tokens: int, **extra: Any) -> list[Sampling]:
    """One `Sampling` per choice; choice i samples with seed + i."""
    bias = tuple((int(k), float(v)) for k, v in (req.logit_bias or {}).items())
    base = engine.sampling(
        max_new_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=bias,
        stop=req.stops(),
        **extra,
    )
    return [replace(base, seed=None if req.seed is None else req.seed + i) for i in range(req.n)]


def create_app(
    engine: Any,
    model_name: str,
    api_key: str | None = None,
    limits: Limits = Limits(),
    bound: str = "127.0.0.1",
    throttle: Throttle | None = None,
) -> Any:
    """The FastAPI app; `bound` is the address it listens on (the Host / Origin checks allow it)."""
    import anyio
    from fastapi import FastAPI, Request, Response

    from lmstack.infer.vision import ImageRun, api_vision, check_vision

    app = FastAPI(title="lmstack api", docs_url=None, redoc_url=None, openapi_url=None)
    _install_error_handlers(app)
    app.add_middleware(Guard, policy=HostPolicy(bound, limits.allowed_hosts))
    throttle = throttle or Throttle()
    created = int(time.time())
    gate = Gate(limits.max_batch + limits.max_queue)
    tokenizing = anyio.CapacityLimiter(1)
    vision = api_vision(engine)
    # Requests with images run outside the continuous batcher (it feeds no pixels): one at a time,
    # through transformers' generate (VisionInputs.run), while the batcher keeps serving text requests.
    imaging = anyio.CapacityLimiter(1)

    def tokenize_chat(conv: list[dict], system: str | None, tools: str | None, max_tokens: int) -> list[int]:
        try:
            ids = engine.prompt_ids(conv, system, tools) if tools else engine.prompt_ids(conv, system)
        except (ValueError, LmstackError) as err:
            raise APIError(400, f"messages: {err}", param="messages") from None
        check_prompt_tokens(len(ids), max_tokens, limits.max_prompt_tokens, engine.max_length)
        return ids

    def tokenize_images(
        conv: list[dict], system: str | None, urls: list[tuple[str, str]], max_tokens: int
    ) -> tuple[list[int], dict]:
        from lmstack.infer.vision import MAX_IMAGE_PIXELS, open_image

        images, pixels = [], 0
        for where, url in urls:
            if not url.startswith("data:"):
                readable_file(where, url, limits.image_dirs)
            try:
                images.append(open_image(url))
            except (ValueError, OSError) as err:
                raise APIError(400, f"{where}: {err}", param="messages") from None
            pixels += images[-1].width * images[-1].height
            if pixels > MAX_IMAGE_PIXELS:  # decoded images are held until the prompt is built
                raise APIError(
                    400,
                    f"{where}: the request's images have {pixels} pixels so far; lmstack decodes at most "
                    f"{MAX_IMAGE_PIXELS} per request: send fewer or smaller images",
                    param="messages",
                )
        try:
            ids, extra = vision.prompt(conv, images, system)
        except (ValueError, LmstackError) as err:
            raise APIError(400, f"messages: {err}", param="messages") from None
        check_prompt_tokens(len(ids), max_tokens, limits.max_prompt_tokens, engine.max_length)
        return ids, extra

    def tokenize_texts(prompts: list[Any], max_tokens: int) -> list[list[int]]:
        out = []
        for prompt in prompts:
            ids = engine.text_ids(prompt) if isinstance(prompt, str) else list(prompt)
            vocab = len(engine.tokenizer)
            bad = next((i for i in ids if not 0 <= i < vocab), None)
            if bad is not None:
                raise APIError(
                    400, f"prompt: token id {bad} is outside the vocabulary (0..{vocab - 1})", param="prompt"
                )
            check_prompt_tokens(len(ids), max_tokens, limits.max_prompt_tokens, engine.max_length, "prompt")
            out.append(ids)
        return out

    async def admitted(request: Request, work: Callable) -> Any:
        """Runs `work(gone)` admitted; `work` returns (response, keeps_admission)."""
        release, gone = gate.admit(), threading.Event()
        if release is None:
            raise _busy(gate, limits)
        try:
            async with until_disconnect(request.receive, gone):
                response, streaming = await work(gone, release)
                if streaming:
                    release = lambda: None  # noqa: E731  (the stream releases it when it ends)
                return response
        finally:
            if gone.is_set():
                logger.info("client disconnected: request dropped")
            release()
        return Response(status_code=499)  # nobody reads it

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict:
        _authorize(request, api_key, throttle)
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "lmstack"}],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        _authorize(request, api_key, throttle)
        req = _validate(ChatRequest, await _read_json(request, limits.read_timeout))
        max_tokens = check_request(req, *_cap(engine, limits))
        check_work(1, req.n, max_tokens, limits.max_batch, limits.max_request_tokens)
        urls = image_urls(req)
        if urls:
            check_vision(engine, vision, urls[0][0])
            check_image_request(req)
        tools, forced = tool_choice(req, engine.tool_format)
        system, conv = to_conversation(req)
        check_prompt_chars(system, conv, limits.max_prompt_tokens)
        json_object = (req.response_format or {}).get("type") == "json_object" or forced is not None
        top = (req.top_logprobs or 0) if req.logprobs else 0
        samplings = _samplings(
            engine, req, max_tokens, logprobs=req.logprobs, top_logprobs=top, json_object=json_object
        )
        reply = Reply(f"chatcmpl-{uuid.uuid4().hex}", req.model, engine.tool_format, req, forced)

        async def work(gone: threading.Event, release: Callable) -> tuple[Any, bool]:
            if urls:
                job = functools.partial(tokenize_images, conv, system, urls, max_tokens)
                ids, extra = await anyio.to_thread.run_sync(job, limiter=tokenizing)
                runs: Any = ImageRun(functools.partial(vision.run, ids, extra, samplings[0], gone), imaging)
            else:
                job = functools.partial(tokenize_chat, conv, system, tools, max_tokens)
                ids = await anyio.to_thread.run_sync(job, limiter=tokenizing)
                if forced is not None:
                    ids = ids + engine.text_ids(reply.forced_prefix, special=False)
                runs = Runs(engine, [(ids, s) for s in samplings], gone)
            if req.stream:
                return event_stream(reply.chat_events(runs), gone, release, limits.stall_timeout), True
            return reply.chat(await runs.results()), False

        return await admitted(request, work)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        _authorize(request, api_key, throttle)
        req = _validate(CompletionRequest, await _read_json(request, limits.read_timeout))
        max_tokens = check_completion(req, *_cap(engine, limits))
        prompts = _prompts(req.prompt)
        check_work(len(prompts), req.n, max_tokens, limits.max_batch, limits.max_request_tokens)
        for p in prompts:
            if isinstance(p, str):
                check_prompt_chars(None, [{"content": p}], limits.max_prompt_tokens, "prompt")
        top = req.logprobs or 0
        samplings = _samplings(engine, req, max_tokens, logprobs=req.logprobs is not None, top_logprobs=top)
        reply = Reply(f"cmpl-{uuid.uuid4().hex}", req.model, engine.tool_format, req, None)

        async def work(gone: threading.Event, release: Callable) -> tuple[Any, bool]:
            job = functools.partial(tokenize_texts, prompts, max_tokens)
            all_ids = await anyio.to_thread.run_sync(job, limiter=tokenizing)
            runs = Runs(engine, [(ids, s) for ids in all_ids for s in samplings], gone)
            reply.prompt_tokens = sum(len(ids) for ids in all_ids)
            if req.stream:
                return event_stream(reply.completion_events(runs), gone, release, limits.stall_timeout), True
            return reply.completion(await runs.results()), False

        return await admitted(request, work)

    return app


def _prompts(prompt: Any) -> list[Any]:
    """A completions `prompt` as a list of prompts (strings or token id lists)."""
    if isinstance(prompt, str) or (prompt and all(isinstance(p, str) for p in prompt)):
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if not all(prompts):
            raise APIError(400, "prompt: an empty string; give the text to complete", param="prompt")
        return prompts
    if prompt and all(isinstance(p, int) for p in prompt):
        return [prompt]
    if not prompt or not all(prompt):  # [] or [[]]: nothing to complete
        raise APIError(400, "prompt: empty", param="prompt")
    return list(prompt)


def _busy(gate: Gate, limits: Limits) -> APIError:
    wait = gate.retry_after
    return APIError(
        503,
        f"server busy: {gate.admitted} requests in progress; at most {limits.max_batch} generate together "
        f"and {limits.max_queue} wait (lmstack api --max-batch, --max-queue); retry after {wait} s",
        "server_error",
        code="queue_full",
        headers={"Retry-After": str(wait)},
    )


def serve(
    engine: Any, host: str, port: int, api_key: str | None, model_name: str, limits: Limits = Limits()
) -> None:
    """Bind first (so port 0 resolves), print the real URL, then run uvicorn on that socket."""
    import uvicorn

    check_bind(host, api_key)
    sock = bind_socket(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    _raise_open_files_limit()
    print(f"lmstack api: serving {model_name!r} at http://{shown}:{bound_port}/v1", flush=True)
    app = create_app(engine, model_name, api_key, limits, bound=host)
    server = uvicorn.Server(server_config(app, limits, log_level="info", access_log=True))
    server.run(sockets=[sock])


KEEP_ALIVE_S = 5  # an idle kept-alive connection closes after this (uvicorn's default, set on purpose)
MAX_HEAD_BYTES = 16 * 1024  # request line and headers: h11's buffer bound, larger is a 400


def server_config(app: Any, limits: Limits, **kwargs: Any) -> Any:
    """uvicorn's settings against slow clients: a deadline on each request's headers (the h11
    protocol of `infer/guard.py`; uvicorn has none of its own), the keep-alive bound and the header
    size bound; the body's deadline and the stream writes' are the app's (`--read-timeout`,
    `--stall-timeout`)."""
    import uvicorn

    return uvicorn.Config(
        app,
        http=deadline_protocol(limits.read_timeout),
        timeout_keep_alive=KEEP_ALIVE_S,
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        **kwargs,
    )


def _raise_open_files_limit() -> None:
    """The soft open-files limit up to the hard one: with the common 1,024, a thousand open sockets
    would leave none for the next client (the header deadline closes them, but only in time)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = hard if hard != resource.RLIM_INFINITY else 1 << 16
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError):  # not POSIX, or not allowed: the soft limit stays
        pass
