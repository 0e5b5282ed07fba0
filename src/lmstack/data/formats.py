"""alpaca / sharegpt / openai records -> one canonical example.

Canonical example (a plain dict):
    prompt:   list of messages, odd length, ending with a user/observation turn
    response: [assistant] for sft; [chosen, rejected] for pairwise; [] when the column is absent (pt)
    system, tools: str | None;  kto_tag: bool | None
    response_field: the record's field path of the trained answer (names it in "empty response")
A record that cannot be converted raises `RecordError(field, kind, detail)`; the loader adds file and
index. Nothing is skipped here: the caller counts every problem by `kind` and lists each one.

Problem kinds (what `lmstack check` and the training log count by): missing field, wrong type,
empty response, empty conversation, wrong role order, unknown role, odd number of turns,
wrong number of turns (ranking), bad JSON line, bad tool call, nested too deeply,
chosen and rejected are identical (ranking).
An `images` column is carried as it is (`images`, `images_field`); data/mm.py checks and expands it.
"""

from __future__ import annotations

import json
from typing import Any

from lmstack.data.encode_common import IDENTICAL
from lmstack.data.registry import DatasetAttr


class RecordError(ValueError):
    """`kind` is the short category counted in reports; `reason` = kind + the detail."""

    def __init__(self, field: str, kind: str, detail: str = ""):
        self.field = field
        self.kind = kind
        self.reason = f"{kind}: {detail}" if detail else kind
        super().__init__(f"{field}: {self.reason}")


def _text(record: dict, column: str | None, required: bool = True) -> str | None:
    if column is None:
        return None
    if column not in record or record[column] is None:
        if required:
            raise RecordError(column, "missing field")
        return None
    value = record[column]
    if not isinstance(value, str):
        raise RecordError(column, "wrong type", f"must be a string, got {type(value).__name__}")
    return value


def _kto_tag(record: dict, column: str | None) -> bool | None:
    if column is None:
        return None
    value = record.get(column)
    if not isinstance(value, bool):
        raise RecordError(column, "wrong type", f"kto tag must be true or false, got {value!r}")
    return value


def _tools(record: dict, column: str | None) -> str | None:
    """The tools column as JSON text: a list of function schemas (objects), given as JSON or as a list."""
    if column is None or record.get(column) in (None, "", []):
        return None
    value = record[column]
    schemas = value
    if isinstance(value, str):
        try:
            schemas = json.loads(value)
        except json.JSONDecodeError as err:
            raise RecordError(column, "wrong type", f"not valid JSON ({err.msg})") from None
    if not isinstance(schemas, list) or not all(isinstance(t, dict) for t in schemas):
        raise RecordError(column, "wrong type", "must be a JSON list of function schemas (objects)")
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
                history_col,
                "wrong type",
                f"must be a list of [question, answer] pairs, got {type(history).__name__}",
            )
        for i, pair in enumerate(history):
            if not (
                isinstance(pair, list | tuple) and len(pair) == 2 and all(isinstance(s, str) for s in pair)
            ):
                raise RecordError(
                    f"{history_col}[{i}]", "wrong type", "must be a [question, answer] pair of strings"
                )
            prompt += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    prompt.append({"role": "user", "content": prompt_text})
    if attr.ranking:
        response = []
        for key in ("chosen", "rejected"):
            col = attr.column(key) or key
            answer = _text(record, col)
            if not answer.strip():
                raise RecordError(col, "empty response")
            response.append({"role": "assistant", "content": answer})
        _check_distinct(response, attr.column("rejected") or "rejected")
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
        "response_field": None if attr.ranking else attr.column("response"),
    }


def _check_distinct(answers: list[dict], col: str) -> None:
    """A preference pair whose two answers are the same text teaches nothing (its margin is 0)."""
    if answers[0] == answers[1]:
        raise RecordError(col, IDENTICAL, "a preference pair needs two different answers")


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
        raise RecordError(where, "wrong type", f"must be an object, got {type(msg).__name__}")
    role_tag, content_tag = attr.tags["role_tag"], attr.tags["content_tag"]
    if role_tag not in msg:
        raise RecordError(f"{where}.{role_tag}", "missing field")
    if msg[role_tag] not in roles:
        raise RecordError(
            f"{where}.{role_tag}", "unknown role", f"{msg[role_tag]!r}; known: {', '.join(roles)}"
        )
    content = msg.get(content_tag)
    if content is None:
        raise RecordError(f"{where}.{content_tag}", "missing field")
    if not isinstance(content, str):
        raise RecordError(
            f"{where}.{content_tag}", "wrong type", f"must be a string, got {type(content).__name__}"
        )
    return {"role": roles[msg[role_tag]], "content": content}


OPENAI_NAMES = {
    "user": "user",
    "assistant": "assistant",
    "observation": "tool",
    "function": "assistant tool_calls",
}


def check_alternation(
    messages: list[dict], col: str, offset: int = 0, names: dict[str, str] | None = None
) -> None:
    """`offset`: index of messages[0] in the record's list (1 when a system message was taken off);
    `names`: canonical role -> the record's own role name, for the message."""
    names = names or {}
    for i, m in enumerate(messages):
        expected = ("user", "observation") if i % 2 == 0 else ("assistant", "function")
        if m["role"] not in expected:
            allowed = " or ".join(repr(names.get(r, r)) for r in expected)
            raise RecordError(
                f"{col}[{i + offset}]",
                "wrong role order",
                f"got {names.get(m['role'], m['role'])!r} where {allowed} is expected "
                "(turns must alternate user/assistant)",
            )


def _split_conversation(messages: list[dict], col: str, attr: DatasetAttr, record: dict) -> tuple[list, list]:
    if attr.ranking:
        if len(messages) % 2 != 1:
            raise RecordError(
                col,
                "wrong number of turns",
                f"{len(messages)} turn(s); a ranking conversation must end with a user turn",
            )
        roles = _role_map(attr)
        answers = []
        for key in ("chosen", "rejected"):
            col = attr.column(key) or key
            if record.get(col) is None:
                raise RecordError(col, "missing field")
            answer = _sharegpt_message(record[col], col, attr, roles)
            if not answer["content"].strip():
                raise RecordError(f"{col}.{attr.tags['content_tag']}", "empty response")
            answers.append(answer)
        _check_distinct(answers, f"{col}.{attr.tags['content_tag']}")
        return messages, answers
    if len(messages) % 2 != 0:
        raise RecordError(
            col,
            "odd number of turns",
            f"{len(messages)} turn(s); a conversation must end with an assistant turn",
        )
    return messages[:-1], messages[-1:]


def convert_sharegpt(record: dict, attr: DatasetAttr) -> dict:
    col = attr.column("messages")
    raw = record.get(col)
    if raw is None:
        raise RecordError(col, "missing field")
    _check_list(raw, col)
    roles = _role_map(attr)
    messages = [_sharegpt_message(m, f"{col}[{i}]", attr, roles) for i, m in enumerate(raw)]
    system = _text(record, attr.column("system"), required=False)
    offset = 0
    if messages[0]["role"] == "system":
        system, offset = messages.pop(0)["content"], 1
    if not messages:
        raise RecordError(col, "empty conversation", "only a system message")
    check_alternation(messages, col, offset, {v: k for k, v in roles.items()})
    last = f"{col}[{len(raw) - 1}].{attr.tags['content_tag']}"
    return _conversation_sample(record, attr, col, messages, system, last)


def _conversation_sample(
    record: dict, attr: DatasetAttr, col: str, messages: list[dict], system: Any, last: str
) -> dict:
    """The canonical sample of a conversation record (sharegpt or openai) in column `col`; `last` names
    the field of the final message, where a bad response is reported."""
    prompt, response = _split_conversation(messages, col, attr, record)
    return {
        "prompt": prompt,
        "response": response,
        "system": system,
        "tools": _tools(record, attr.column("tools")),
        "kto_tag": _kto_tag(record, attr.column("kto_tag")),
        "response_field": None if attr.ranking else last,
    }


def _check_list(raw: Any, col: str) -> None:
    if not isinstance(raw, list):
        raise RecordError(col, "wrong type", f"must be a list of messages, got {type(raw).__name__}")
    if not raw:
        raise RecordError(col, "empty conversation", "the message list is empty")


def _openai_messages(raw: list, col: str) -> tuple[list[dict], str | None]:
    system, out = None, []
    for i, msg in enumerate(raw):
        where = f"{col}[{i}]"
        if not isinstance(msg, dict):
            raise RecordError(where, "wrong type", f"must be an object, got {type(msg).__name__}")
        if "role" not in msg:
            raise RecordError(f"{where}.role", "missing field")
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
                f"{where}.role", "unknown role", f"{role!r}; known: system (first), user, assistant, tool"
            )
    return out, system


def _content(msg: dict, where: str) -> str:
    content = msg.get("content")
    if content is None:
        raise RecordError(f"{where}.content", "missing field")
    if not isinstance(content, str):
        raise RecordError(f"{where}.content", "wrong type", f"must be a string, got {type(content).__name__}")
    return content


def _tool_call(call: Any, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or "name" not in fn:
        raise RecordError(where, "bad tool call", "needs function.name and function.arguments")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args else {}
        except json.JSONDecodeError:
            raise RecordError(f"{where}.function.arguments", "bad tool call", "not valid JSON") from None
    return {"name": fn["name"], "arguments": args}


def convert_openai(record: dict, attr: DatasetAttr) -> dict:
    col = attr.column("messages") if "messages" in attr.columns else "messages"
    raw = record.get(col)
    if raw is None:
        raise RecordError(col, "missing field")
    _check_list(raw, col)
    messages, system = _openai_messages(raw, col)
    if not messages:
        raise RecordError(col, "empty conversation", "only a system message")
    _check_openai_order(messages, raw, col)
    return _conversation_sample(record, attr, col, messages, system, f"{col}[{len(raw) - 1}].content")


def _check_openai_order(messages: list[dict], raw: list, col: str) -> None:
    """Alternation on the merged list, but errors name the index in the record's own list."""
    raw_index = []
    for i, msg in enumerate(raw):
        role = msg["role"]
        if role == "system" and i == 0:
            continue
        if role == "tool" and i > 0 and raw[i - 1]["role"] == "tool" and raw_index:
            continue  # merged into the previous observation
        raw_index.append(i)
    try:
        check_alternation(messages, col, names=OPENAI_NAMES)
    except RecordError as err:
        pos = int(err.field[len(col) + 1 : -1])
        raise RecordError(f"{col}[{raw_index[pos]}]", err.kind, err.reason[len(err.kind) + 2 :]) from None


CONVERTERS = {"alpaca": convert_alpaca, "sharegpt": convert_sharegpt, "openai": convert_openai}


def convert(record: Any, attr: DatasetAttr) -> dict:
    if not isinstance(record, dict):
        raise RecordError("<record>", "wrong type", f"must be an object, got {type(record).__name__}")
    try:
        out = CONVERTERS[attr.formatting](record, attr)
    except RecursionError:  # a value nested nearly as deep as the JSON reader allows, then serialized
        raise RecordError("<record>", "nested too deeply", "flatten the value or remove the record") from None
    for key in ("images", "videos", "audios"):  # LF's media columns: checked and expanded in data/mm.py
        column = attr.column(key)
        if column:
            out.update({key: record.get(column), f"{key}_field": column})
    return out
