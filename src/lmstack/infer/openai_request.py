"""What an OpenAI chat / completions request may ask of `lmstack api` (`infer/server.py`), checked
before any model work: the request models, the conversation the template can render (tool calls and
results included), `n`/`stop`/`logprobs`/`response_format`/`tools`/`tool_choice`, `max_tokens`
against its cap, and the prompt's size (characters before tokenizing, tokens after). Fields lmstack
cannot honour (`functions`, `audio`, `echo`, ...) are refused by name, never ignored. `image_url` parts
are checked here (user messages only, no network URL, absolute paths) and become `<image>` in the
text. Every refusal is an `APIError` that the server turns into OpenAI's JSON error shape."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

CHARS_PER_TOKEN = 32  # a prompt longer than this per allowed token is refused without tokenizing it


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.code, self.headers = code, headers


MAX_N = 16  # choices per request
MAX_TOP_LOGPROBS = 20
SEED_MAX = 2**63 - 1 - 16  # a torch.Generator takes 64-bit seeds; choice i samples with seed + i (n <= 16)
MAX_LOGIT_BIAS = 300  # OpenAI's bound: each entry costs work at every decoding step
UNSUPPORTED = ("functions", "function_call", "audio", "prediction", "web_search_options")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="ignore")
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["image_url"]
    image_url: ImageURL


Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self, image: str = "") -> str:
        """The text parts joined, `image` where each image part was."""
        if isinstance(self.content, list):
            return "".join(p.text if isinstance(p, TextPart) else image for p in self.content)
        return self.content or ""

    def images(self) -> list[tuple[int, ImageURL]]:
        """(part index, image_url) of each image part."""
        parts = self.content if isinstance(self.content, list) else []
        return [(j, p.image_url) for j, p in enumerate(parts) if isinstance(p, ImagePart)]


class Function(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: Function


class Sampled(BaseModel):
    """Fields chat and completions share."""

    model_config = ConfigDict(extra="ignore")
    model: str
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # vLLM's extension
    repetition_penalty: float | None = Field(None, gt=0)  # vLLM's extension
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    n: int = Field(1, ge=1)
    seed: int | None = Field(None, ge=-(2**63), le=SEED_MAX)  # int64, as OpenAI's; choice i adds i
    stop: str | list[str] | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(Sampled):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    response_format: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None


class CompletionRequest(Sampled):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


def to_conversation(req: ChatRequest) -> tuple[str | None, list[dict]]:
    """OpenAI messages -> (system, lmstack messages); 400 on what the template cannot render.
    An assistant message with tool calls becomes a `function` turn, tool results `observation`
    turns (consecutive ones joined by newlines)."""
    from lmstack.data.mm import IMAGE_PLACEHOLDER

    messages = list(req.messages)
    system = None
    if messages[0].role in ("system", "developer"):
        system = messages.pop(0).text()
    conv: list[dict] = []
    for i, m in enumerate(messages, start=1 if system is not None else 0):
        if m.role in ("system", "developer"):
            raise APIError(400, f"messages[{i}]: a system message is only allowed first", param="messages")
        if m.tool_calls:
            conv.append({"role": "function", "content": _calls_text(i, m)})
        elif m.role == "tool" and conv and conv[-1]["role"] == "observation":
            conv[-1]["content"] += "\n" + m.text()
        else:
            role = "observation" if m.role == "tool" else m.role
            conv.append({"role": role, "content": m.text(IMAGE_PLACEHOLDER)})
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


def image_urls(req: ChatRequest) -> list[tuple[str, str]]:
    """(where, url) of each image part, in prompt order (where: "messages[i].content[j]"); 400 for an
    image outside a user message, a network URL, a relative path or a `detail` lmstack cannot honour."""
    found = []
    for i, m in enumerate(req.messages):
        for j, image in m.images():
            where, url = f"messages[{i}].content[{j}]", image.url
            if m.role != "user":
                raise APIError(
                    400,
                    f"{where}: image_url is allowed in user messages only (got {m.role!r})",
                    param="messages",
                )
            if image.detail not in (None, "auto"):
                raise APIError(
                    400,
                    f"{where}.image_url.detail: got {image.detail!r}; lmstack api sizes images by the YAML's "
                    "image_max_pixels / image_min_pixels: leave detail out or send 'auto'",
                    param="messages",
                )
            if not url.startswith("data:"):
                _check_local(where, url)
            found.append((where, url))
    return found


def _check_local(where: str, url: str) -> None:
    from pathlib import Path

    if "://" in url and not url.startswith("file://"):
        raise APIError(
            400,
            f"{where}.image_url.url: {url[:80]!r}: this server reads no network (it runs offline); send the "
            "image as a data URL (data:image/png;base64,...) or as a file on the server (/abs/path.png or "
            "file:///abs/path.png)",
            param="messages",
        )
    if not Path(url.removeprefix("file://")).is_absolute():
        raise APIError(
            400,
            f"{where}.image_url.url: {url[:80]!r}: a file on the server must be given by its absolute path "
            "(/abs/path.png or file:///abs/path.png), or send a data URL",
            param="messages",
        )


def check_image_request(req: ChatRequest) -> None:
    """What a request with images cannot ask for: replies to images are generated one at a time with
    plain sampling (`infer/vision.py`)."""
    if req.n != 1:
        raise APIError(400, f"n: got {req.n}; a request with images returns one choice (n: 1)", param="n")
    kind = (req.response_format or {}).get("type", "text")
    for name, value in (
        ("logprobs", req.logprobs),
        ("tools", req.tools),
        ("response_format", kind != "text"),
        ("presence_penalty", req.presence_penalty),
        ("frequency_penalty", req.frequency_penalty),
        ("logit_bias", req.logit_bias),
    ):
        if value:
            raise APIError(
                400,
                f"{name}: not supported in a request with images; leave it out for image requests",
                param=name,
            )


def _calls_text(i: int, m: Message) -> str:
    if m.role != "assistant":
        raise APIError(400, f"messages[{i}]: only assistant messages carry tool_calls", param="messages")
    if m.text().strip():
        raise APIError(
            400,
            f"messages[{i}]: an assistant message with tool_calls must have empty content (the "
            "template writes the calls alone)",
            param="messages",
        )
    calls = []
    for j, call in enumerate(m.tool_calls or []):
        try:
            arguments = json.loads(call.function.arguments or "{}")
        except ValueError:
            raise APIError(
                400,
                f"messages[{i}].tool_calls[{j}].function.arguments: not valid JSON",
                param="messages",
            ) from None
        calls.append({"name": call.function.name, "arguments": arguments})
    return json.dumps(calls, ensure_ascii=False)


def check_common(req: Sampled, default: int, cap: int, cap_source: str, wanted: int | None) -> int:
    """Checks shared by chat and completions; returns max_tokens."""
    if req.n > MAX_N:
        raise APIError(400, f"n: got {req.n}; this server returns at most {MAX_N} choices", param="n")
    stops = req.stops()
    if len(stops) > 4 or not all(0 < len(s) <= 256 for s in stops):
        raise APIError(400, "stop: give up to 4 non-empty strings of at most 256 characters", param="stop")
    if len(req.logit_bias or {}) > MAX_LOGIT_BIAS:
        raise APIError(
            400,
            f"logit_bias: {len(req.logit_bias or {})} entries; at most {MAX_LOGIT_BIAS}",
            param="logit_bias",
        )
    for key, bias in (req.logit_bias or {}).items():
        if not key.isdigit() or not -100 <= bias <= 100:
            raise APIError(
                400,
                f"logit_bias: {key!r}: {bias}; keys are token ids, values between -100 and 100",
                param="logit_bias",
            )
    wanted = wanted or min(default, cap)
    if wanted > cap:
        raise APIError(
            400,
            f"max_tokens: got {wanted}; this server allows at most {cap} ({cap_source})",
            param="max_tokens",
            code="max_tokens_exceeded",
        )
    return wanted


def check_work(prompts: int, n: int, max_tokens: int, max_batch: int, max_tokens_total: int) -> None:
    """One request's work is bounded before it is queued: its sequences (prompts x n) fit in one
    batch, and the tokens they may generate (x max_tokens) are at most --max-request-tokens, so a
    small body cannot queue more work than the server's other clients get together."""
    sequences = prompts * n
    if sequences > max_batch:
        raise APIError(
            400,
            f"prompts x n: {prompts} x {n} = {sequences} sequences; this server generates at most "
            f"{max_batch} per request (lmstack api --max-batch): send fewer prompts or a smaller n",
            param="n",
        )
    total = sequences * max_tokens
    if total > max_tokens_total:
        raise APIError(
            400,
            f"prompts x n x max_tokens: {prompts} x {n} x {max_tokens} = {total} tokens to generate; this "
            f"server allows at most {max_tokens_total} per request (lmstack api --max-request-tokens)",
            param="max_tokens",
        )


def check_request(req: ChatRequest, default: int, cap: int, cap_source: str) -> int:
    for name in UNSUPPORTED:
        if getattr(req, name) is not None:
            raise APIError(400, f"{name}: not supported by lmstack api", param=name)
    if req.modalities not in (None, ["text"]):
        raise APIError(
            400, f"modalities: got {req.modalities}; only ['text'] is supported", param="modalities"
        )
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
        if req.top_logprobs > MAX_TOP_LOGPROBS:
            raise APIError(
                400, f"top_logprobs: got {req.top_logprobs}; at most {MAX_TOP_LOGPROBS}", param="top_logprobs"
            )
    kind = (req.response_format or {}).get("type", "text")
    if kind not in ("text", "json_object"):
        raise APIError(
            400,
            f"response_format: type {kind!r} is not supported; use 'json_object' (any JSON object) or 'text'",
            param="response_format",
        )
    return check_common(req, default, cap, cap_source, req.max_completion_tokens or req.max_tokens)


def check_completion(req: CompletionRequest, default: int, cap: int, cap_source: str) -> int:
    if req.echo:
        raise APIError(400, "echo: not supported by lmstack api; leave it false", param="echo")
    if req.suffix:
        raise APIError(400, "suffix: not supported by lmstack api (no fill-in-the-middle)", param="suffix")
    if req.best_of not in (None, req.n):
        raise APIError(400, f"best_of: got {req.best_of}; only best_of = n is supported", param="best_of")
    if req.logprobs is not None and req.logprobs > MAX_TOP_LOGPROBS:
        raise APIError(400, f"logprobs: got {req.logprobs}; at most {MAX_TOP_LOGPROBS}", param="logprobs")
    return check_common(req, default, cap, cap_source, req.max_tokens)


def tool_choice(req: ChatRequest, tool_format: str) -> tuple[str | None, str | None]:
    """(tools JSON for the prompt, the name of a forced function); (None, None) without tools."""
    from lmstack.infer.toolcalls import FORCEABLE, PARSEABLE

    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice: needs tools", param="tool_choice")
        return None, None
    if tool_format not in PARSEABLE:
        raise APIError(
            400,
            f"tools: the template's tool format {tool_format!r} cannot be read back by lmstack api; "
            f"formats it reads: {', '.join(PARSEABLE)} (LF's tool_format field)",
            param="tools",
        )
    names = [t.function.name for t in req.tools]
    tools = json.dumps([t.model_dump(exclude_none=True) for t in req.tools], ensure_ascii=False)
    if choice in (None, "auto", "none"):
        return tools, None
    if choice == "required" and len(names) > 1:
        raise APIError(
            400,
            f"tool_choice: 'required' with {len(names)} tools: lmstack api forces one named function; "
            'name it ({"type": "function", "function": {"name": ...}}), send only that tool, or use "auto"',
            param="tool_choice",
        )
    if choice == "required":  # one tool: calling a tool is calling that one
        name = names[0]
    else:
        name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if name not in names:
        raise APIError(
            400, f"tool_choice: names {name!r}, which is not among the tools {names}", param="tool_choice"
        )
    if tool_format not in FORCEABLE:
        raise APIError(
            400,
            f"tool_choice: a named function cannot be forced in tool format {tool_format!r}; formats that "
            f"can: {', '.join(FORCEABLE)}; or use tool_choice 'auto'",
            param="tool_choice",
        )
    return tools, name


def _too_long(message: str, field: str = "messages") -> APIError:
    return APIError(400, message, param=field, code="context_length_exceeded")


def check_prompt_chars(system: str | None, conv: list[dict], limit: int, field: str = "messages") -> None:
    """Before tokenizing: a prompt of more characters than `limit` tokens could hold is refused."""
    chars = len(system or "") + sum(len(m["content"]) for m in conv)
    if chars > limit * CHARS_PER_TOKEN:
        raise _too_long(
            f"{field}: the prompt has {chars} characters; this server allows at most {limit} tokens "
            f"(lmstack api --max-prompt-tokens), so at most {limit * CHARS_PER_TOKEN} characters",
            field,
        )


def check_prompt_tokens(
    prompt_len: int, max_tokens: int, limit: int, context: int | None, field: str = "messages"
) -> None:
    if prompt_len > limit:
        raise _too_long(
            f"{field}: the prompt has {prompt_len} tokens; this server allows at most {limit} "
            "(lmstack api --max-prompt-tokens)",
            field,
        )
    if context and prompt_len + max_tokens > context:
        raise _too_long(
            f"{field}: the prompt has {prompt_len} tokens; with max_tokens {max_tokens} it exceeds "
            f"the model's {context}-token context",
            field,
        )


def validation_message(err: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in err.errors())
