"""Writes lf_golden.json: what LLaMA-Factory 0.9.5's own template code produces, for every template
lmstack ships and a set of conversations. test_template_parity.py checks lmstack against it.

Not a test (needs LLaMA-Factory's source, which CI does not have). To regenerate:

    pip download --no-deps llamafactory==0.9.5 -d /tmp/lf && unzip -q /tmp/lf/*.whl -d /tmp/lf
    PYTHONPATH=src python tests/unit/templates/make_lf_golden.py /tmp/lf/llamafactory

Only LF's `data/template.py`, `formatter.py` and `tool_utils.py` are executed (their package imports are
replaced by small stand-ins: a logger, the Role enum, a no-op multimodal plugin). The tokenizer is a
stand-in that returns every text element as one "id", so the file records LF's *elements* (the pieces
it tokenizes one by one) for each message: the test turns them into real ids with any tokenizer.
An element is an index into `strings` (a text), -1 / -2 (the bos / eos id) or {"token": NAME}.
The llama3 tool prompt's date is pinned to DATE.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import enum
import importlib.util
import json
import sys
import types
from pathlib import Path

DATE = dt.datetime(2024, 7, 26)
OUT = Path(__file__).with_name("lf_golden.json")
KNOBS_PLAIN = [(True, False, False)]
KNOBS_REASONING = [  # (enable_thinking, preserve_thinking, mask_history)
    (True, False, False),
    (False, False, False),
    (None, False, False),
    (True, True, False),
    (True, False, True),
    (False, True, True),
]


def load_lf(src: Path) -> types.ModuleType:
    """LF's data/template.py with stand-ins for the heavy package imports."""
    for name in ("llamafactory", "llamafactory.extras", "llamafactory.data"):
        sys.modules[name] = types.ModuleType(name)
        sys.modules[name].__path__ = []
    log = types.ModuleType("llamafactory.extras.logging")
    silent = {k: (lambda *a, **kw: None) for k in ("info_rank0", "warning_rank0", "info", "warning")}
    log.get_logger = lambda name=None: types.SimpleNamespace(**silent)
    sys.modules["llamafactory.extras.logging"] = sys.modules["llamafactory.extras"].logging = log
    utils = types.ModuleType("llamafactory.data.data_utils")
    utils.Role = enum.StrEnum(
        "Role", {k.upper(): k for k in ("user", "assistant", "system", "function", "observation")}
    )
    utils.SLOTS = list
    sys.modules["llamafactory.data.data_utils"] = utils
    mm = types.ModuleType("llamafactory.data.mm_plugin")
    mm.get_mm_plugin = lambda *a, **kw: None
    sys.modules["llamafactory.data.mm_plugin"] = mm
    for sub in ("tool_utils", "formatter", "template"):
        name = f"llamafactory.data.{sub}"
        spec = importlib.util.spec_from_file_location(name, src / "data" / f"{sub}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    sys.modules["llamafactory.data.tool_utils"].datetime = types.SimpleNamespace(now=lambda: DATE)
    return sys.modules["llamafactory.data.template"]


class ElementTokenizer:
    """Every text element is one 'id' (the text itself); specials are tagged tuples."""

    bos_token, eos_token = "<BOS>", "<EOS>"
    bos_token_id, eos_token_id = ("special", "bos_token"), ("special", "eos_token")

    def encode(self, text: str, add_special_tokens: bool = False) -> list:
        return [text]

    def convert_tokens_to_ids(self, token: str) -> tuple:
        return ("token", token)


TOOLS = json.dumps(
    [
        {
            "name": "get_weather",
            "description": "Get the weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name"},
                    "days": {"type": "integer", "description": "How many days", "enum": ["1", "2"]},
                    "hours": {"type": "array", "items": {"type": "integer"}},
                },
                "required": ["city"],
            },
        },
        {
            "type": "function",
            "function": {
                "name": "noop",
                "description": "",
                "parameters": {"type": "object", "properties": {}},
            },
        },
    ]
)
CALL = json.dumps(
    {
        "name": "get_weather",
        "arguments": {"city": "Paris", "days": 2, "hours": [8, True, None], "x": {"b": 1}},
    }
)
THOUGHT_SCENARIOS = ("chat", "thoughts", "call_with_thought", "thoughts_tools")  # all knobs for these
PARALLEL = json.dumps(
    [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "noop", "arguments": {}}]
)


def scenarios(open_: str, close: str, reasoning: bool):
    def m(role: str, content: str) -> dict:
        return {"role": role, "content": content}

    def th(text: str) -> str:
        return open_ + text + close

    chat = [m("user", "Hi"), m("assistant", "Yo"), m("user", "Q"), m("assistant", "Ans")]
    tool_chat = [m("user", "Q"), m("function", CALL), m("observation", '{"t": 22}'), m("assistant", "Ans")]
    yield "chat", chat, "S", None
    yield "chat_default_system", chat, None, None
    yield "tools", tool_chat, "S", TOOLS
    yield "tools_only", tool_chat, "", TOOLS
    yield "tools_empty_list", chat[:2], "", "[]"
    yield "parallel_calls", [*tool_chat[:1], m("function", PARALLEL), *tool_chat[2:]], "", TOOLS
    yield "call_with_thought", [*tool_chat[:1], m("function", th("need") + CALL), *tool_chat[2:]], "", TOOLS
    yield (
        "call_in_markers",
        [*tool_chat[:1], m("function", f"Ok.\n<tool_call>{CALL}</tool_call>"), *tool_chat[2:]],
        "",
        TOOLS,
    )
    yield (
        "thoughts",
        [m("user", "2+2?"), m("assistant", th("add") + "4."), m("user", "3+3?"), m("assistant", "6.")],
        "",
        None,
    )
    if reasoning:
        chain = [
            m("user", "Q"),
            m("function", th("tool") + CALL),
            m("observation", "R"),
            m("assistant", th("ok") + "A"),
        ]
        yield "thoughts_tools", chain, "S", TOOLS


SPECIAL_CODES = {"bos_token": -1, "eos_token": -2}


class Strings:
    """The golden's string table: each distinct text element is stored once, elements are indices."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}

    def element(self, e: str | tuple) -> int | dict:
        if isinstance(e, str):
            return self.index.setdefault(e, len(self.index))
        return SPECIAL_CODES[e[1]] if e[0] == "special" else {"token": e[1]}

    def elements(self, ids: list) -> list:
        return [self.element(e) for e in ids]


def _run(fn):
    try:
        return fn()
    except Exception as err:  # LF's own error: lmstack must refuse the same input
        return {"error": type(err).__name__}


def case(template, tok, table: Strings, messages, system, tools, knobs, reasoning: bool) -> dict:
    """LF's encodings of one conversation. Plain templates store only the multiturn pairs: their
    oneturn prompt is every message but the last, as LF's Template.encode_oneturn concatenates them."""
    enable, preserve, mask = knobs
    template.enable_thinking, template.preserve_thinking = enable, preserve
    msgs = lambda: copy.deepcopy(messages)  # noqa: E731
    multi = _run(lambda: template.encode_multiturn(tok, msgs(), system, tools, mask and not preserve))
    out = {
        "knobs": list(knobs),
        "multiturn": multi
        if isinstance(multi, dict)
        else [[table.elements(s), table.elements(t)] for s, t in multi],
    }
    if reasoning:
        one = _run(lambda: template.encode_oneturn(tok, msgs(), system, tools))
        gen = msgs()[:-1] + [{"role": "assistant", "content": ""}]
        prompt = _run(lambda: template.encode_oneturn(tok, gen, system, tools)[0])
        out["oneturn"] = one if isinstance(one, dict) else [table.elements(one[0]), table.elements(one[1])]
        out["prompt"] = prompt if isinstance(prompt, dict) else table.elements(prompt)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lf", type=Path, help="the llamafactory package folder of LLaMA-Factory 0.9.5")
    lf = load_lf(parser.parse_args().lf)
    from lmstack.templates import list_templates

    tok, table = ElementTokenizer(), Strings()
    out = {
        "llamafactory": "0.9.5",
        "date": DATE.strftime("%d %b %Y"),
        "strings": [],
        "inputs": {},
        "templates": {},
    }
    for name in list_templates():
        if name not in lf.TEMPLATES:  # baichuan2: an older LF name, not in 0.9.5
            continue
        template = lf.TEMPLATES[name]
        reasoning = isinstance(template, lf.ReasoningTemplate)
        entries = []
        for scenario, messages, system, tools in scenarios(*template.thought_words, reasoning):
            knobs_list = KNOBS_REASONING if reasoning and scenario in THOUGHT_SCENARIOS else KNOBS_PLAIN
            runs = [case(template, tok, table, messages, system, tools, k, reasoning) for k in knobs_list]
            key = json.dumps([scenario, messages, system, tools], ensure_ascii=False)
            inputs = out["inputs"].setdefault(key, {"id": len(out["inputs"]), "scenario": scenario})
            inputs.update(messages=messages, system=system, tools=tools)
            entries.append({"input": inputs["id"], "runs": runs})
        out["templates"][name] = {"reasoning": reasoning, "cases": entries}
    out["strings"] = list(table.index)
    out["inputs"] = [{k: v for k, v in i.items() if k != "id"} for i in out["inputs"].values()]
    text = json.dumps(out, ensure_ascii=False, separators=(",", ":"))
    OUT.write_text(text.replace('{"input"', '\n{"input"') + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({OUT.stat().st_size // 1024} KiB, {len(out['templates'])} templates)")


if __name__ == "__main__":
    main()
