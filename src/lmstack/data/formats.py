"""alpaca / sharegpt / openai records -> one canonical example.

Canonical example (a plain dict):
    prompt:   list of messages, odd length, ending with a user/observation turn
    response: [assistant] for sft; [chosen, rejected] for pairwise; [] when the column is absent (pt)
    system, tools: str | None;  kto_tag: bool | None
A record that cannot be converted raises `RecordError(field, reason)`; the loader adds file and index.
Nothing is skipped here: the caller counts and reports every problem.
"""

from __future__ import annotations

import json
from typing import Any

from lmstack.data.registry import DatasetAttr


class RecordError(ValueError):
    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def _text(record: dict, column: str | None, required: bool = True) -> str | None:
    if column is None:
        return None
    if column not in record or record[column] is None:
        if required:
            raise RecordError(column, "missing field")
        return None
    value = record[column]
    if not isinstance(value, str):
        raise RecordError(column, f"must be a string, got {type(value).__name__}")
    return value


def _kto_tag(record: dict, column: str | None) -> bool | None:
    if column is None:
        return None
    value = record.get(column)
    if not isinstance(value, bool):
        raise RecordError(column, f"kto tag must be true or false, got {value!r}")
    return value


def _tools(record: dict, column: str | None) -> str | None:
    if column is None or record.get(column) in (None, "", []):
        return None
    value = record[column]
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def convert_alpaca(record: dict, attr: DatasetAttr) -> dict:
    prompt_text = _text(record, attr.column("prompt")) or ""
    query = _text(record, attr.column("query"), required=False)
    if query:
        prompt_text = f"{prompt_text}\n{query}" if prompt_text else query
    prompt: list[dict] = []
    history_col = attr.column("history")
    history = record.get(history_col) if history_col else None
    if history:
        if not isinstance(history, list):
            raise RecordError(
                history_col, f"must be a list of [question, answer] pairs, got {type(history).__name__}"
            )
        for i, pair in enumerate(history):
            if not (
                isinstance(pair, list | tuple) and len(pair) == 2 and all(isinstance(s, str) for s in pair)
            ):
                raise RecordError(f"{history_col}[{i}]", "must be a [question, answer] pair of strings")
            prompt += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    prompt.append({"role": "user", "content": prompt_text})
    if attr.ranking:
        response = [
            {"role": "assistant", "content": _text(record, attr.column("chosen") or "chosen")},
            {"role": "assistant", "content": _text(record, attr.column("rejected") or "rejected")},
        ]
    else:
        out = _text(
            record,
            attr.column("response"),
            required=attr.columns.get("response") is not None or attr.column("response") in record,
        )
        response = [] if out is None else [{"role": "assistant", "content": out}]
    return {
        "prompt": prompt,
        "response": response,
        "system": _text(record, attr.column("system"), required=False),
        "tools": _tools(record, attr.column("tools")),
        "kto_tag": _kto_tag(record, attr.column("kto_tag")),
    }


def _role_map(attr: DatasetAttr) -> dict[str, str]:
    t = attr.tags
    return {
        t["user_tag"]: "user",
        t["assistant_tag"]: "assistant",
        t["observation_tag"]: "observation",
        t["function_tag"]: "function",
        t["system_tag"]: "system",
    }


def _sharegpt_message(msg: Any, where: str, attr: DatasetAttr, roles: dict[str, str]) -> dict:
    if not isinstance(msg, dict):
        raise RecordError(where, f"must be an object, got {type(msg).__name__}")
    role_tag, content_tag = attr.tags["role_tag"], attr.tags["content_tag"]
    if role_tag not in msg:
        raise RecordError(f"{where}.{role_tag}", "missing field")
    if msg[role_tag] not in roles:
        raise RecordError(f"{where}.{role_tag}", f"unknown role {msg[role_tag]!r}; known: {', '.join(roles)}")
    content = msg.get(content_tag)
    if not isinstance(content, str):
        raise RecordError(
            f"{where}.{content_tag}",
            "missing field" if content is None else f"must be a string, got {type(content).__name__}",
        )
    return {"role": roles[msg[role_tag]], "content": content}


def check_alternation(messages: list[dict], col: str) -> None:
    for i, m in enumerate(messages):
        expected = ("user", "observation") if i % 2 == 0 else ("assistant", "function")
        if m["role"] not in expected:
            raise RecordError(
                f"{col}[{i}]",
                f"wrong role order: got {m['role']!r} where {' or '.join(expected)} "
                "is expected (turns must alternate user/assistant)",
            )


def _split_conversation(messages: list[dict], col: str, attr: DatasetAttr, record: dict) -> tuple[list, list]:
    if attr.ranking:
        if len(messages) % 2 != 1:
            raise RecordError(col, "ranking conversations must end with a user turn (odd number of turns)")
        roles = _role_map(attr)
        chosen = _sharegpt_message(record.get(attr.column("chosen") or "chosen"), "chosen", attr, roles)
        rejected = _sharegpt_message(
            record.get(attr.column("rejected") or "rejected"), "rejected", attr, roles
        )
        return messages, [chosen, rejected]
    if len(messages) % 2 != 0:
        raise RecordError(
            col, f"odd number of turns ({len(messages)}); a conversation must end with an assistant turn"
        )
    return messages[:-1], messages[-1:]


def convert_sharegpt(record: dict, attr: DatasetAttr) -> dict:
    col = attr.column("messages")
    raw = record.get(col)
    if raw is None:
        raise RecordError(col, "missing field")
    if not isinstance(raw, list) or not raw:
        raise RecordError(col, "must be a non-empty list of messages")
    roles = _role_map(attr)
    messages = [_sharegpt_message(m, f"{col}[{i}]", attr, roles) for i, m in enumerate(raw)]
    system = _text(record, attr.column("system"), required=False)
    if messages[0]["role"] == "system":
        system = messages.pop(0)["content"]
    if not messages:
        raise RecordError(col, "has only a system message")
    check_alternation(messages, col)
    prompt, response = _split_conversation(messages, col, attr, record)
    return {
        "prompt": prompt,
        "response": response,
        "system": system,
        "tools": _tools(record, attr.column("tools")),
        "kto_tag": _kto_tag(record, attr.column("kto_tag")),
    }


def _openai_messages(raw: list, col: str) -> tuple[list[dict], str | None]:
    system, out = None, []
    for i, msg in enumerate(raw):
        where = f"{col}[{i}]"
        if not isinstance(msg, dict) or "role" not in msg:
            raise RecordError(where, "must be an object with a role")
        role = msg["role"]
        if role == "system" and i == 0:
            system = msg.get("content") or ""
        elif role == "user":
            out.append({"role": "user", "content": _content(msg, where)})
        elif role == "assistant" and msg.get("tool_calls"):
            calls = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(msg["tool_calls"])]
            out.append(
                {
                    "role": "function",
                    "content": json.dumps(calls[0] if len(calls) == 1 else calls, ensure_ascii=False),
                }
            )
        elif role == "assistant":
            out.append({"role": "assistant", "content": _content(msg, where)})
        elif role == "tool":
            if out and out[-1]["role"] == "observation":  # consecutive tool results -> one observation
                out[-1]["content"] += "\n" + _content(msg, where)
            else:
                out.append({"role": "observation", "content": _content(msg, where)})
        else:
            raise RecordError(
                f"{where}.role", f"unknown role {role!r}; known: system (first), user, assistant, tool"
            )
    return out, system


def _content(msg: dict, where: str) -> str:
    content = msg.get("content")
    if not isinstance(content, str):
        raise RecordError(f"{where}.content", "missing field" if content is None else "must be a string")
    return content


def _tool_call(call: Any, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or "name" not in fn:
        raise RecordError(where, "a tool call needs function.name and function.arguments")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args else {}
        except json.JSONDecodeError:
            raise RecordError(f"{where}.function.arguments", "is not valid JSON") from None
    return {"name": fn["name"], "arguments": args}


def convert_openai(record: dict, attr: DatasetAttr) -> dict:
    col = attr.column("messages") if "messages" in attr.columns else "messages"
    raw = record.get(col)
    if not isinstance(raw, list) or not raw:
        raise RecordError(col, "missing field" if raw is None else "must be a non-empty list of messages")
    messages, system = _openai_messages(raw, col)
    check_alternation(messages, col)
    prompt, response = _split_conversation(messages, col, attr, record)
    return {
        "prompt": prompt,
        "response": response,
        "system": system,
        "tools": _tools(record, attr.column("tools")),
        "kto_tag": _kto_tag(record, attr.column("kto_tag")),
    }


CONVERTERS = {"alpaca": convert_alpaca, "sharegpt": convert_sharegpt, "openai": convert_openai}


def convert(record: Any, attr: DatasetAttr) -> dict:
    if not isinstance(record, dict):
        raise RecordError("<record>", f"must be an object, got {type(record).__name__}")
    return CONVERTERS[attr.formatting](record, attr)
