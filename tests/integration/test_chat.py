"""`lmstack chat` driven through a pseudo-terminal: streamed replies with history, `clear`, `exit`;
on a training YAML, chat (like api and export) uses what training wrote to output_dir."""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

import pexpect
import pytest
import torch
import yaml

from lmstack.config.errors import ConfigError
from lmstack.infer.engine import ChatEngine, load_infer_config
from lmstack.train.run import train


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


# ---- a training YAML: chat/api/export use what training wrote to output_dir --------------------
HELLO = [{"role": "user", "content": "Hello there"}]
_RUNS: dict[str, dict] = {}


@pytest.fixture
def runs(base_cfg, tmp_path_factory) -> dict[str, dict]:
    """Training YAMLs (as dicts) of a LoRA and a full SFT run, trained once per module."""
    if not _RUNS:
        root = tmp_path_factory.mktemp("chat_runs")
        for kind in ("lora", "full"):
            run = {
                **base_cfg,
                "finetuning_type": kind,
                "output_dir": str(root / kind),
                "max_steps": 3,
                "max_samples": 24,
                "do_sample": False,
                "max_new_tokens": 10,
            }
            train(None, run)
            _RUNS[kind] = run
    return _RUNS


def inference_only(run: dict) -> dict:
    keep = ("model_name_or_path", "template", "do_sample", "max_new_tokens")
    return {k: run[k] for k in keep}


def logits(model, tokenizer) -> torch.Tensor:
    ids = torch.tensor([tokenizer("Hello, how can I help you today?")["input_ids"]])
    with torch.no_grad():
        return model(input_ids=ids.to(model.device)).logits.float()


def test_chat_on_a_lora_training_yaml_uses_the_adapter_in_output_dir_and_says_so(runs, tmp_path):
    run = runs["lora"]
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(run))
    explicit = {**run, "adapter_name_or_path": run["output_dir"]}
    expected = ChatEngine.from_config(load_infer_config(None, explicit)).generate(HELLO).text
    base = ChatEngine.from_config(load_infer_config(None, inference_only(run))).generate(HELLO).text
    assert expected != base  # the adapter changes the reply

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
    try:
        child.expect_exact("Type `clear` to forget the history, `exit` to quit.")
        startup = child.before.replace("\r\n", "\n")
        child.expect_exact("User: ")
        child.sendline("Hello there")
        child.expect_exact("Assistant: ")
        child.expect_exact("User: ")
        reply = child.before.replace("\r\n", "\n")
        child.sendline("exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    line = f"adapter_name_or_path is unset: using the LoRA adapter trained in output_dir {run['output_dir']}"
    assert reply == expected + "\n\n"
    assert line in startup


def test_a_full_training_yaml_loads_the_weights_in_output_dir_and_says_so(runs, caplog):
    from transformers import AutoModelForCausalLM

    run = runs["full"]
    with caplog.at_level(logging.INFO, logger="lmstack.infer"):
        cfg = load_infer_config(None, run)
    engine = ChatEngine.from_config(cfg)
    trained = AutoModelForCausalLM.from_pretrained(run["output_dir"], dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(run["model_name_or_path"], dtype=torch.float32).eval()
    expected = logits(trained, engine.tokenizer)
    assert not torch.allclose(expected, logits(base, engine.tokenizer), atol=1e-3)  # training changed it
    torch.testing.assert_close(logits(engine.model, engine.tokenizer), expected, atol=1e-5, rtol=0)
    assert cfg.model.model_name_or_path == run["output_dir"] and cfg.model.adapter_name_or_path is None
    assert f"loading the full-finetuned model trained in output_dir {run['output_dir']}" in caplog.text


@pytest.mark.parametrize("where", ["unset", "emptied by an override", "missing", "empty", "checkpoints only"])
def test_without_trained_outputs_the_base_model_is_used_and_a_line_says_so(
    runs, tiny_model, tmp_path, caplog, where
):
    out = tmp_path / "run"
    if where == "empty":
        out.mkdir()
    if where == "checkpoints only":  # an interrupted run: no final adapter in output_dir itself
        shutil.copytree(Path(runs["lora"]["output_dir"]) / "checkpoint-3", out / "checkpoint-3")
    run = {**inference_only(runs["lora"]), "finetuning_type": "lora"}
    if where == "emptied by an override":  # `lmstack chat train.yaml output_dir=`: the base model
        run = {**runs["lora"], "output_dir": None}
    elif where != "unset":
        run["output_dir"] = str(out)
    with caplog.at_level(logging.INFO, logger="lmstack.infer"):
        cfg = load_infer_config(None, run)
    assert (cfg.model.model_name_or_path, cfg.model.adapter_name_or_path) == (str(tiny_model), None)
    if where in ("unset", "emptied by an override"):
        assert (
            f"adapter_name_or_path and output_dir are unset: using the base model {tiny_model}" in caplog.text
        )
    else:
        assert f"output_dir {out} holds no trained outputs" in caplog.text
        assert f"using the base model {tiny_model}" in caplog.text
    if where == "checkpoints only":
        assert "checkpoint-3" in caplog.text and "adapter_name_or_path" in caplog.text


def test_an_adapter_trained_on_another_base_is_refused_naming_both(runs, tiny_model, tmp_path):
    run = runs["lora"]
    other = tmp_path / "other-base"
    shutil.copytree(tiny_model, other)
    with pytest.raises(ConfigError) as err:
        load_infer_config(None, {**run, "model_name_or_path": str(other)})
    message = str(err.value)
    assert (
        f"was trained on {str(tiny_model)!r}" in message
        and f"model_name_or_path is {str(other)!r}" in message
    )
    assert f"set model_name_or_path: {tiny_model}" in message
    # the same base under another spelling of its path is no mismatch
    same = tmp_path / "elsewhere" / tiny_model.name
    shutil.copytree(tiny_model, same)
    cfg = load_infer_config(None, {**run, "model_name_or_path": str(same)})
    assert cfg.model.adapter_name_or_path == run["output_dir"]
    # an explicit adapter_name_or_path is taken as given, as before
    explicit = {**run, "model_name_or_path": str(other), "adapter_name_or_path": run["output_dir"]}
    assert load_infer_config(None, explicit).model.model_name_or_path == str(other)


@pytest.mark.parametrize(
    "kind, finetuning_type, message",
    [
        ("lora", "full", r"holds a LoRA adapter \(adapter_config.json\) but finetuning_type is 'full'"),
        (
            "full",
            "lora",
            r"holds full model weights \(config.json \+ model.safetensors\) but finetuning_type is",
        ),
    ],
)
def test_outputs_that_do_not_match_finetuning_type_are_refused(runs, kind, finetuning_type, message):
    with pytest.raises(ConfigError, match=message):
        load_infer_config(None, {**runs[kind], "finetuning_type": finetuning_type})
