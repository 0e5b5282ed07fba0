"""Every shipped template encodes as LLaMA-Factory 0.9.5 does: same pieces, same ids, same labels.

`lf_golden.json` holds, for every template and a set of conversations (system prompt, default system,
tools, tools-only, `tools: "[]"`, parallel calls, calls with thoughts, thoughts in history), the
elements LLaMA-Factory's own `Template.encode_multiturn` / `encode_oneturn` produce, written by
`make_lf_golden.py` from LF's source (not from lmstack). Here each element is tokenized on its own
with a real tokenizer, as LF does, and compared with lmstack's ids, rendered text and SFT labels.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmstack.data.encode import IGNORE_INDEX, EncodeOptions, encode_supervised
from lmstack.templates import get_template, list_templates
from lmstack.tiny import build_tokenizer

GOLDEN = json.loads(Path(__file__).with_name("lf_golden.json").read_text(encoding="utf-8"))
STRINGS, INPUTS, TEMPLATES = GOLDEN["strings"], GOLDEN["inputs"], GOLDEN["templates"]


@pytest.fixture(autouse=True)
def golden_date(monkeypatch):
    """The llama3 tool prompt writes today's date; the golden was written with a fixed one."""
    monkeypatch.setattr("lmstack.templates.tools.today", lambda: GOLDEN["date"])


@pytest.fixture(scope="module")
def tok():
    tok = build_tokenizer(STRINGS[:200], vocab_size=2000)
    tok.add_special_tokens({"bos_token": "<s>"})
    named = {e["token"] for t in TEMPLATES.values() for c in t["cases"] for r in c["runs"] for e in _walk(r)}
    tok.add_special_tokens({"additional_special_tokens": sorted(named)}, replace_extra_special_tokens=False)
    return tok


def _walk(run: dict):
    for key in ("multiturn", "oneturn", "prompt"):
        stack = [run.get(key, [])]
        while stack:
            item = stack.pop()
            if isinstance(item, list):
                stack += item
            elif isinstance(item, dict) and "token" in item:
                yield item


def ids(tok, elements: list) -> list[int]:
    out: list[int] = []
    for e in elements:
        if isinstance(e, dict):
            out.append(tok.convert_tokens_to_ids(e["token"]))
        elif e == -1:
            out += [tok.bos_token_id]
        elif e == -2:
            out += [tok.eos_token_id]
        elif STRINGS[e]:
            out += tok.encode(STRINGS[e], add_special_tokens=False)
    return out


def text(tok, elements: list) -> str:
    named = {-1: tok.bos_token, -2: tok.eos_token}
    return "".join(e["token"] if isinstance(e, dict) else named.get(e) or STRINGS[e] for e in elements)


def lf_supervised(pairs: list, mask_history: bool, efficient_eos: bool, eos: int) -> tuple[list, list]:
    """LF 0.9.5's SupervisedDatasetProcessor labels (no truncation): sources masked, answers trained;
    efficient-EOS templates label each later source's first token EOS and end with one EOS."""
    input_ids, labels = [], []
    for turn, (src, tgt) in enumerate(pairs[::-1] if mask_history else pairs):
        src_label = [IGNORE_INDEX] * len(src)
        if efficient_eos and turn != 0:
            src_label = [eos] + [IGNORE_INDEX] * (len(src) - 1)
        tgt_label = [IGNORE_INDEX] * len(tgt) if mask_history and turn != 0 else tgt
        if mask_history:
            input_ids, labels = src + tgt + input_ids, src_label + tgt_label + labels
        else:
            input_ids, labels = input_ids + src + tgt, labels + src_label + tgt_label
    if efficient_eos:
        input_ids, labels = input_ids + [eos], labels + [eos]
    return input_ids, labels


NOT_IN_LF_0_9_5 = {"baichuan2"}  # an older LF name, checked by hand in test_template_render.py


def test_the_golden_covers_every_shipped_template():
    assert sorted(TEMPLATES) == [n for n in list_templates() if n not in NOT_IN_LF_0_9_5]
    assert len(TEMPLATES) == 121


def _expected(tok, run: dict, reasoning: bool) -> dict:
    """LF's multiturn pairs, oneturn (prompt, answer) and generation prompt, as ids."""
    pairs = [(ids(tok, s), ids(tok, t)) for s, t in run["multiturn"]]
    if reasoning:
        one = run["oneturn"]
        oneturn = None if "error" in one else (ids(tok, one[0]), ids(tok, one[1]))
        prompt = None if "error" in run["prompt"] else ids(tok, run["prompt"])
    else:  # LF's plain Template: the oneturn prompt is every message but the last, concatenated
        head = [i for s, t in pairs[:-1] for i in s + t] + pairs[-1][0]
        oneturn, prompt = (head, pairs[-1][1]), head
    return {"multiturn": pairs, "oneturn": oneturn, "prompt": prompt}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_ids_text_and_labels_equal_llamafactory(tok, name):
    golden = TEMPLATES[name]
    template = get_template(name)
    assert template.reasoning == golden["reasoning"]
    for case in golden["cases"]:
        inp = INPUTS[case["input"]]
        messages, system, tools = inp["messages"], inp["system"], inp["tools"]
        for run in case["runs"]:
            enable, preserve, mask = run["knobs"]
            kw = {"tools": tools, "enable_thinking": enable, "preserve_thinking": preserve}
            where = (name, inp["scenario"], run["knobs"])
            if "error" in run["multiturn"]:  # LF refuses the conversation: so does lmstack
                with pytest.raises(ValueError):
                    template.encode_multiturn(tok, messages, system, mask_history=mask, **kw)
                continue
            want = _expected(tok, run, golden["reasoning"])
            assert (
                template.encode_multiturn(tok, messages, system, mask_history=mask, **kw) == want["multiturn"]
            ), where
            assert template.encode_oneturn(tok, messages, system, **kw) == want["oneturn"], where
            assert template.encode_prompt(tok, messages[:-1], system, **kw) == want["prompt"], where
            pairs = template.render_pairs(messages, system, tok, mask_history=mask, **kw)
            assert pairs == [(text(tok, s), text(tok, t)) for s, t in run["multiturn"]], where
            example = {"prompt": messages[:-1], "response": messages[-1:], "system": system, "tools": tools}
            opts = EncodeOptions(
                "sft", 10**6, mask_history=mask, enable_thinking=enable, preserve_thinking=preserve
            )
            row, _ = encode_supervised(example, tok, template, opts)
            lf_ids, lf_labels = lf_supervised(
                want["multiturn"], mask, template.efficient_eos, tok.eos_token_id
            )
            assert (row["input_ids"], row["labels"]) == (lf_ids, lf_labels), where
