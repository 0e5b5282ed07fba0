"""The OpenAI response bodies and SSE chunks of `lmstack api` (split from infer/server.py): chat and
text completions, their streamed events, logprobs and usage."""

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from lmstack.infer.sampling import Generation, Piece, TokenLogprob

logger = logging.getLogger(__name__)


def _usage(prompt_tokens: int, results: list[Generation]) -> dict:
    completion = sum(r.completion_tokens for r in results)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def _chat_logprobs(entries: list[TokenLogprob]) -> dict:
    def one(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, _, lp in e.top]} for e in entries
        ]
    }


def _text_logprobs(entries: list[TokenLogprob], offset: int) -> dict:
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t: lp for t, _, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


class Reply:
    """Builds one request's responses (plain or SSE chunks) from its sequences' results."""

    def __init__(self, reply_id: str, model: str, tool_format: str, req: Any, forced: str | None):
        self.id, self.model, self.tool_format, self.req, self.forced = (
            reply_id,
            model,
            tool_format,
            req,
            forced,
        )
        self.created = int(time.time())
        self.prompt_tokens = 0
        self.tools = bool(getattr(req, "tools", None)) and getattr(req, "tool_choice", None) != "none"
        self.forced_prefix = ""
        if forced is not None:
            from lmstack.infer.toolcalls import forced_call_text

            self.forced_prefix = forced_call_text(tool_format, forced)[0]

    # ---- chat -----------------------------------------------------------------------------
    def message(self, result: Generation) -> tuple[dict, str]:
        """(message, finish_reason), with tool calls read from the text when tools are on."""
        from lmstack.infer.toolcalls import parse_tool_calls

        content: str | None = result.text
        calls: list = []
        if self.forced is not None:
            try:
                calls, content = [(self.forced, json.loads(result.text))], None
            except ValueError:  # cut by max_tokens: the arguments are incomplete
                return {"role": "assistant", "content": result.text}, result.finish_reason
        elif self.tools:
            content, calls = parse_tool_calls(self.tool_format, result.text)
            if self.req.parallel_tool_calls is False:
                calls = calls[:1]
            content = content or None if calls else content
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if not calls:
            return message, result.finish_reason
        message["tool_calls"] = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
            }
            for name, args in calls
        ]
        return message, "tool_calls"

    def chat(self, results: list[Generation]) -> dict:
        choices = []
        for i, result in enumerate(results):
            message, finish = self.message(result)
            choice = {"index": i, "message": message, "finish_reason": finish, "logprobs": None}
            if result.logprobs is not None:
                choice["logprobs"] = _chat_logprobs(result.logprobs)
            choices.append(choice)
        prompt = results[0].prompt_tokens if results else 0
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": _usage(prompt, results),
        }

    def _chunk(self, kind: str, choices: list, **extra: Any) -> str:
        body = {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        return f"data: {json.dumps({**body, **extra}, ensure_ascii=False)}\n\n"

    async def chat_events(self, runs: Any) -> AsyncIterator[str]:
        """Per choice: a role chunk, content chunks, a finish chunk; then [usage], [DONE]."""
        kind = "chat.completion.chunk"
        usage = bool((self.req.stream_options or {}).get("include_usage"))
        buffered = self.tools or self.forced is not None  # the reply may be a call: sent whole at its end

        def delta(i: int, content: dict, finish: str | None = None, logprobs: Any = None) -> str:
            return self._chunk(
                kind, [{"index": i, "delta": content, "logprobs": logprobs, "finish_reason": finish}]
            )

        results: dict[int, Generation] = {}
        try:
            yield "".join(delta(i, {"role": "assistant", "content": ""}) for i in range(runs.count))
            async for batch in runs.batches():  # one write per batch of events
                chunks = []
                for i, event in batch:
                    if isinstance(event, Piece):
                        if not buffered:
                            lp = _chat_logprobs(event.logprobs) if self.req.logprobs else None
                            chunks.append(delta(i, {"content": event.text}, logprobs=lp))
                        continue
                    results[i] = event
                    if buffered:
                        message, finish = self.message(event)
                        message.pop("role")
                        lp = _chat_logprobs(event.logprobs) if event.logprobs is not None else None
                        if message.get("tool_calls"):
                            for j, call in enumerate(message["tool_calls"]):
                                call["index"] = j
                        content = {k: v for k, v in message.items() if v is not None}
                        chunks += [delta(i, content, logprobs=lp), delta(i, {}, finish)]
                    else:
                        chunks.append(delta(i, {}, event.finish_reason))
                if chunks:
                    yield "".join(chunks)
            if usage:
                ordered = [results[i] for i in sorted(results)]
                prompt = ordered[0].prompt_tokens if ordered else 0
                yield self._chunk(kind, [], usage=_usage(prompt, ordered))
        except Exception as exc:  # the response has started: report in-band
            logger.error("stream failed: %s", exc, exc_info=exc)
            failed = {
                "error": {"message": f"generation failed ({type(exc).__name__})", "type": "server_error"}
            }
            yield f"data: {json.dumps(failed)}\n\n"
        yield "data: [DONE]\n\n"

    # ---- completions ----------------------------------------------------------------------
    def completion(self, results: list[Generation]) -> dict:
        choices = [
            {
                "index": i,
                "text": r.text,
                "logprobs": None if r.logprobs is None else _text_logprobs(r.logprobs, 0),
                "finish_reason": r.finish_reason,
            }
            for i, r in enumerate(results)
        ]
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": _usage(self.prompt_tokens, results),
        }

    async def completion_events(self, runs: Any) -> AsyncIterator[str]:
        kind = "text_completion"
        usage = bool((self.req.stream_options or {}).get("include_usage"))
        results, offsets = [], [0] * runs.count
        try:
            async for batch in runs.batches():  # one write per batch of events
                chunks = []
                for i, event in batch:
                    if isinstance(event, Piece):
                        logprobs = self.req.logprobs is not None
                        lp = _text_logprobs(event.logprobs, offsets[i]) if logprobs else None
                        offsets[i] += len(event.text)
                        choice = {"index": i, "text": event.text, "logprobs": lp, "finish_reason": None}
                    else:
                        results.append(event)
                        finish = event.finish_reason
                        choice = {"index": i, "text": "", "logprobs": None, "finish_reason": finish}
                    chunks.append(self._chunk(kind, [choice]))
                yield "".join(chunks)
            if usage:
                yield self._chunk(kind, [], usage=_usage(self.prompt_tokens, results))
        except Exception as exc:
            logger.error("stream failed: %s", exc, exc_info=exc)
            failed = {
                "error": {"message": f"generation failed ({type(exc).__name__})", "type": "server_error"}
            }
            yield f"data: {json.dumps(failed)}\n\n"
        yield "data: [DONE]\n\n"
