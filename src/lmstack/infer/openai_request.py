"""What an OpenAI chat request may ask of `lmstack api` (`infer/server.py`), checked before any
model work: the request models, the conversation the template can render, `n`/`stop`/`tools`,
`max_tokens` against its cap, and the prompt's size (characters before tokenizing, tokens after).
Every refusal is an `APIError` that the server turns into OpenAI's JSON error shape."""

from __future__ import annotations

from typing import Any, Literal

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


def check_request(req: ChatRequest, default: int, cap: int, cap_source: str) -> int:
    if req.n != 1:
        raise APIError(400, f"n: got {req.n}; only n=1 is supported", param="n")
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    if len(stops) > 4 or not all(0 < len(s) <= 256 for s in stops):
        raise APIError(400, "stop: give up to 4 non-empty strings of at most 256 characters", param="stop")
    if req.tools:
        raise APIError(400, "tools: tool calling is not supported by lmstack api yet", param="tools")
    wanted = req.max_completion_tokens or req.max_tokens or min(default, cap)
    if wanted > cap:
        raise APIError(
            400,
            f"max_tokens: got {wanted}; this server allows at most {cap} ({cap_source})",
            param="max_tokens",
            code="max_tokens_exceeded",
        )
    return wanted


def _too_long(message: str) -> APIError:
    return APIError(400, message, param="messages", code="context_length_exceeded")


def check_prompt_chars(system: str | None, conv: list[dict], limit: int) -> None:
    """Before tokenizing: a prompt of more characters than `limit` tokens could hold is refused."""
    chars = len(system or "") + sum(len(m["content"]) for m in conv)
    if chars > limit * CHARS_PER_TOKEN:
        raise _too_long(
            f"messages: the prompt has {chars} characters; this server allows at most {limit} tokens "
            f"(lmstack api --max-prompt-tokens), so at most {limit * CHARS_PER_TOKEN} characters"
        )


def check_prompt_tokens(prompt_len: int, max_tokens: int, limit: int, context: int | None) -> None:
    if prompt_len > limit:
        raise _too_long(
            f"messages: the prompt has {prompt_len} tokens; this server allows at most {limit} "
            "(lmstack api --max-prompt-tokens)"
        )
    if context and prompt_len + max_tokens > context:
        raise _too_long(
            f"messages: the prompt has {prompt_len} tokens; with max_tokens {max_tokens} it exceeds "
            f"the model's {context}-token context"
        )


def validation_message(err: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in err.errors())
