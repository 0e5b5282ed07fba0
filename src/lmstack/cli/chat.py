"""`lmstack chat cfg.yaml [key=value ...]`: terminal chat with the base (+ adapters) and the
training template; streaming output; `clear` forgets the history, `exit` quits."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TextIO

WELCOME = "Welcome to lmstack chat. Type `clear` to forget the history, `exit` to quit."


def chat_loop(
    session, read: Callable[[str], str] = input, out: TextIO = sys.stdout, prompts: bool = True
) -> None:
    """Read a line, stream the reply; Ctrl-C stops a reply (the turn is dropped), Ctrl-D quits.
    `prompts=False` (stdin is a pipe or a file): no welcome, no `User:`/`Assistant:` labels, one reply
    per input line, so the output is the replies alone."""
    if prompts:
        print(WELCOME, file=out, flush=True)
    while True:
        try:
            query = read("\nUser: " if prompts else "")
        except UnicodeDecodeError:
            print("could not decode the input; set the terminal encoding to UTF-8", file=out, flush=True)
            continue
        except EOFError:
            if prompts:
                print(file=out)
            return
        command = query.strip()
        if command == "exit":
            return
        if command == "clear":
            session.clear()
            if prompts:
                print("History has been removed.", file=out, flush=True)
            continue
        if not command:
            continue
        if prompts:
            print("Assistant: ", end="", file=out, flush=True)
        reply = session.send(query)
        try:
            for piece in reply:
                print(piece, end="", file=out, flush=True)
        except KeyboardInterrupt:
            reply.close()
            print(" [stopped]", end="", file=out)
        print(file=out, flush=True)


def cmd_chat(args: argparse.Namespace) -> int:
    from lmstack.infer.engine import ChatSession, keep_unused_out, load_infer_config

    keep_unused_out(args.config, args.overrides)  # before transformers is imported
    from lmstack.infer.engines import load_engine
    from lmstack.infer.vision import session_for

    cfg = load_infer_config(args.config, args.overrides)
    engine = load_engine(cfg)  # infer_backend: huggingface | vllm | sglang
    # a vision model: `/image PATH` attaches one (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: `/video PATH` too; Qwen2-Audio: `/audio PATH`)
    session = session_for(engine) or ChatSession(engine)
    if sys.stdin.isatty():
        chat_loop(session)
    else:  # piped: input() would still write its prompt to stdout
        chat_loop(session, read=lambda _prompt: input(), prompts=False)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat",
        help="chat in the terminal with the model (+ adapters) and the training template",
        description=(
            "Terminal chat: streaming replies, history; `clear` forgets the history, `exit` quits. "
            "Generation settings (do_sample, temperature, top_p, top_k, max_new_tokens, "
            "repetition_penalty) come from the YAML; infer_backend (huggingface | vllm | sglang) picks "
            "the engine."
        ),
    )
    p.add_argument(
        "config",
        help="YAML config; a training YAML works: with adapter_name_or_path unset, the adapter or model "
        "trained in its output_dir is used (output_dir= on the command line: the base model)",
    )
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. temperature=0.7")
    p.set_defaults(func=cmd_chat)
