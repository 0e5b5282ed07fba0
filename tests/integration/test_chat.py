"""`lmstack chat` driven through a pseudo-terminal: streamed replies with history, `clear`, `exit`."""

from __future__ import annotations

import os
import sys

import pexpect
import yaml

from lmstack.infer.engine import ChatEngine, load_infer_config


def test_chat_in_a_terminal_streams_replies_keeps_history_and_clears_it(tiny_model, tmp_path):
    cfg = {
        "model_name_or_path": str(tiny_model),
        "template": "qwen",
        "do_sample": False,
        "max_new_tokens": 10,
    }
    path = tmp_path / "chat.yaml"
    path.write_text(yaml.safe_dump(cfg))
    engine = ChatEngine.from_config(load_infer_config(None, cfg))
    first = engine.generate([{"role": "user", "content": "Hello there"}]).text
    second = engine.generate(
        [
            {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": first},
            {"role": "user", "content": "Tell me more"},
        ]
    ).text
    without_history = engine.generate([{"role": "user", "content": "Tell me more"}]).text
    assert first and second and second != without_history  # the history changes the reply

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    child = pexpect.spawn(
        sys.executable,
        ["-m", "lmstack.cli.main", "chat", str(path)],
        encoding="utf-8",
        codec_errors="replace",
        timeout=180,
        env=env,
        dimensions=(50, 1000),
    )

    def ask(text: str) -> str:
        child.sendline(text)
        child.expect_exact("Assistant: ")
        child.expect_exact("User: ")
        return child.before.replace("\r\n", "\n")

    try:
        child.expect_exact("Type `clear` to forget the history, `exit` to quit.")
        child.expect_exact("User: ")
        assert ask("Hello there") == first + "\n\n"
        assert ask("Tell me more") == second + "\n\n"
        child.sendline("clear")
        child.expect_exact("History has been removed.")
        child.expect_exact("User: ")
        assert ask("Tell me more") == without_history + "\n\n"
        child.sendline("exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before


def test_generation_stops_at_the_template_stop_words_and_hides_them(tiny_model):
    import dataclasses

    import torch

    cfg = load_infer_config(
        None,
        {"model_name_or_path": str(tiny_model), "template": "qwen", "do_sample": False, "max_new_tokens": 10},
    )
    engine = ChatEngine.from_config(cfg)
    hello = [{"role": "user", "content": "Hello there"}]
    prompt = engine.prompt_ids(hello)
    with torch.no_grad():
        out = engine.model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)
    free = out[0, len(prompt) :].tolist()
    assert engine.generate(hello).finish_reason == "length"
    stop_id = free[3]
    k = free.index(stop_id)  # generation stops at the first occurrence
    word = engine.tokenizer.convert_ids_to_tokens(stop_id)
    template = dataclasses.replace(engine.template, stop_words=("<|im_end|>", word))
    stopping = ChatEngine(cfg, engine.model, engine.tokenizer, template)
    assert stop_id in stopping.stop_ids
    result = stopping.generate(hello)
    assert (result.completion_tokens, result.finish_reason) == (k + 1, "stop")
    assert result.text == engine.tokenizer.decode(free[:k], skip_special_tokens=True)
    stream = stopping.stream(hello)
    assert "".join(stream) == result.text and stream.result == result


def test_stop_strings_end_the_reply_before_them_also_when_streaming(tiny_model):
    import re

    cfg = load_infer_config(
        None,
        {"model_name_or_path": str(tiny_model), "template": "qwen", "do_sample": False, "max_new_tokens": 12},
    )
    engine = ChatEngine.from_config(cfg)
    hello = [{"role": "user", "content": "Hello there"}]
    full = engine.generate(hello).text
    match = re.search(r"[A-Za-z]{2}", full[1:])
    assert match, full
    stop = match.group(0)
    expected = full[: full.find(stop)]
    result = engine.generate(hello, stop=["never-produced", stop])
    assert (result.text, result.finish_reason) == (expected, "stop")
    stream = engine.stream(hello, stop=[stop])
    pieces = list(stream)
    assert "".join(pieces) == expected and stream.result.text == expected
    assert stream.result.finish_reason == "stop"
