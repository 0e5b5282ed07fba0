"""`lmstack` command line: argv parsing only; each subcommand is a small function."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import textwrap

from lmstack import __version__
from lmstack.cli.plan import register as register_plan
from lmstack.cli.plan import split_plan_items
from lmstack.config.errors import LmstackError

logger = logging.getLogger("lmstack")

# Subcommands that live in their own module `lmstack.cli.<name>`, each with `register(subparsers)`.
EXTRA_COMMANDS: tuple[str, ...] = ("check", "export", "chat", "api", "env", "webui")


class SourceFormatter(logging.Formatter):
    """`[lmstack] LEVEL message` for lmstack's own records; another library's records carry its name
    (`[torchao] WARNING ...`), so a third-party warning never reads as lmstack's."""

    def __init__(self, rank_tag: str = ""):
        super().__init__("%(levelname)s %(message)s")
        self.rank_tag = rank_tag

    def format(self, record: logging.LogRecord) -> str:
        source = record.name.split(".", 1)[0]
        source = "lmstack" if source in ("lmstack", "root", "__main__") else source
        return f"[{source}{self.rank_tag}] {super().format(record)}"


def setup_logging(verbose: bool = False) -> None:
    from lmstack.launch.context import topology

    ctx = topology()
    rank = str(ctx.rank)
    level = logging.DEBUG if verbose else logging.INFO
    if rank != "0":
        level = logging.WARNING
    tag = "" if rank == "0" else f" rank{rank}"
    logging.basicConfig(level=level, stream=sys.stderr, force=True)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(SourceFormatter(tag))
    for noisy in ("httpx", "urllib3", "filelock", "datasets", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from lmstack.config import secrets

    secrets.install()  # tokens/keys masked in every log record, warning and uncaught traceback
    if ctx.world_size > 1:  # every rank says it started; ranks > 0 pass only warnings above: own logger
        announce = logging.getLogger("lmstack.rank")
        announce.setLevel(logging.INFO)
        announce.info(
            "rank %s/%d on %s: local rank %d, pid %d",
            rank,
            ctx.world_size,
            ctx.hostname,
            ctx.local_rank,
            os.getpid(),
        )


def fields_help() -> str:
    from lmstack.config.schema import SECTIONS

    lines = ["fields (flat YAML keys, LLaMA-Factory names; override with key=value):"]
    for section, cls in SECTIONS.items():
        lines.append(f"\n  [{section}]")
        for name, info in cls.model_fields.items():
            default = "required" if info.is_required() else f"default {info.default!r}"
            text = info.description or ""
            note = "" if f"({default})" in text else f" ({default})"  # a description may say it already
            lines.append(f"    {name:<36} {text}{note}")
    from lmstack.templates import list_templates

    names = textwrap.fill(
        ", ".join(list_templates()), width=106, initial_indent="    ", subsequent_indent="    "
    )
    lines += ["\n  template names (LLaMA-Factory's; see src/lmstack/templates/builtin):", names]
    return "\n".join(lines)


TRAIN_USAGE = "lmstack train [CONFIG.yaml|.json] [key=value | --key value | --key=value | --flag ...]"


def split_train_args(items: list[str]) -> tuple[str | None, list[str]]:
    """LF's forms: `train cfg.yaml [key=value ...]`, `train cfg.yaml --key value ...` and
    `train --key value --flag ...` (no file). The first item is the config file unless it is an option
    or a key=value pair."""
    if items and not items[0].startswith("-") and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def cmd_train(args: argparse.Namespace) -> int:
    from lmstack.train.run import train

    if any(item in ("-h", "--help") for item in args.args):
        args.train_parser.print_help()
        return 0
    config, overrides = split_train_args(args.args)
    if config is not None:
        train(config, overrides, own_process=True)
        return 0
    # flags only: they become the run's YAML, so a torchrun relaunch hands the same config to every rank
    import tempfile

    import yaml

    from lmstack.config.load import parse_overrides

    flat = parse_overrides(overrides)
    fd, path = tempfile.mkstemp(prefix="lmstack_flags_", suffix=".yaml")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            yaml.safe_dump(flat, handle, sort_keys=False, allow_unicode=True)
        train(path, [], own_process=True)
    finally:
        os.unlink(path)
    return 0


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from lmstack.tiny import build_tiny_model, build_tiny_vision_model

    if args.vision:
        path = build_tiny_vision_model(args.dir, args.vision, data_dir=args.data_dir)
    else:
        path = build_tiny_model(args.dir, data_dir=args.data_dir, arch=args.arch)
    print(f"tiny model written to {path}")
    return 0


def cmd_version(args: argparse.Namespace) -> int:
    print(f"lmstack {__version__}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from lmstack.tiny import VISION_FAMILIES  # plain names; tiny.py imports torch only when it builds

    parser = argparse.ArgumentParser(
        prog="lmstack",
        description="One YAML file drives the whole LLM training stack.",
        epilog="Run `lmstack <command> --help` for a command's options.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"lmstack {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")

    # prefix_chars="+": every `--key` after `train` is a config field (LF's argparse form), not an option
    p = sub.add_parser(
        "train",
        help="train with a YAML config and/or --key value flags (stages sft, ...)",
        description="Train a model. LLaMA-Factory's forms: a YAML (or JSON) config, followed by key=value "
        "or --key value overrides; or only --key value flags (a bare --flag means true).",
        usage=TRAIN_USAGE,
        epilog=fields_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        prefix_chars="+",
        add_help=False,
    )
    p.add_argument("args", nargs="*", help="config file, then key=value / --key value / --flag")
    p.set_defaults(func=cmd_train, train_parser=p)

    p = sub.add_parser(
        "tiny-model", help="build the offline tiny model + tokenizer used by the quickstart and tests"
    )
    p.add_argument("dir", help="output directory")
    p.add_argument("--data-dir", default="data", help="demo data the tokenizer is trained on (default: data)")
    p.add_argument("--arch", default="qwen2", choices=["qwen2", "llama"], help="architecture")
    p.add_argument(
        "--vision",
        choices=list(VISION_FAMILIES),
        help="a vision-language (or Qwen2-Audio) model instead, with its image processor / feature extractor",
    )
    p.set_defaults(func=cmd_tiny_model)

    register_plan(sub)

    p = sub.add_parser("version", help="print the version")
    p.set_defaults(func=cmd_version)
    for name in EXTRA_COMMANDS:
        module = importlib.import_module(f"lmstack.cli.{name}")
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides anywhere (`plan k=v cfg --gpus 8 k=v`) are overrides, as in `train`
    if extra and hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "command", None) == "plan":
        try:
            args.config, args.overrides = split_plan_items([args.config, *args.overrides])
        except argparse.ArgumentTypeError as err:
            parser.error(str(err))
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    setup_logging(args.verbose)
    try:
        return args.func(args)
    except LmstackError as err:
        from lmstack.config.secrets import redact
        from lmstack.reliability import TrainingStopped

        # a requested stop (SIGTERM/SIGINT, 143/130) saved a checkpoint: it is no error
        prefix = "" if isinstance(err, TrainingStopped) else "error: "
        print(f"{prefix}{redact(str(err))}", file=sys.stderr)
        return getattr(err, "exit_code", 2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
