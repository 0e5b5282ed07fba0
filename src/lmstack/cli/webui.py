"""`lmstack webui [--host H] [--port P] [--auth user:pass | --auth-file F] [--share-dir D] [--lang L]`:
the browser UI (Gradio, the `webui` extra). Binds 127.0.0.1 by default; any non-loopback address
needs a login (--auth or --auth-file), since the UI starts training runs and reads files."""

from __future__ import annotations

import argparse
from pathlib import Path

from lmstack.config.errors import ConfigError

DEFAULT_SHARE_DIR = "lmstack_webui"


def parse_auth(auth: str | None, auth_file: str | None) -> list[tuple[str, str]]:
    """`user:pass` or a file of `user:pass` lines (blank lines and `#` comments skipped)."""
    if auth is not None:
        return [_pair(auth, "--auth")]
    if auth_file is None:
        return []
    path = Path(auth_file)
    if not path.is_file():
        raise ConfigError(f"--auth-file: {auth_file} does not exist; give a file of user:password lines")
    pairs = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#"):
            pairs.append(_pair(line.strip(), f"--auth-file {auth_file} line {i}"))
    if not pairs:
        raise ConfigError(f"--auth-file: {auth_file} holds no user:password line")
    return pairs


def _pair(text: str, where: str) -> tuple[str, str]:
    user, sep, password = text.partition(":")
    if not sep or not user or not password:
        raise ConfigError(f"{where}: expected user:password (both non-empty), got {'***' if sep else text!r}")
    return user, password


def check_bind(host: str, auth: list[tuple[str, str]]) -> None:
    from lmstack.infer.limits import is_loopback
    from lmstack.webui.access import MIN_PASSWORD_CHARS

    if is_loopback(host):
        return
    if not auth:
        raise ConfigError(
            f"--host {host}: not a loopback address; the web UI starts training and reads files on this "
            "machine, so listening there needs a login: add --auth user:password or --auth-file FILE"
        )
    for user, password in auth:
        if len(password) < MIN_PASSWORD_CHARS:
            raise ConfigError(
                f"--auth: the password of {user!r} has {len(password)} characters; on {host}, reachable "
                f"from other machines, it needs at least {MIN_PASSWORD_CHARS} (make one with: python -c "
                "'import secrets; print(secrets.token_urlsafe(12))'), or bind 127.0.0.1"
            )


def require_gradio() -> None:
    try:
        import gradio  # noqa: F401
    except ImportError:
        raise ConfigError(
            "lmstack webui needs Gradio, which is not installed: pip install 'lmstack[webui]'"
        ) from None


def cmd_webui(args: argparse.Namespace) -> int:
    auth = parse_auth(args.auth, args.auth_file)
    check_bind(args.host, auth)
    require_gradio()
    from lmstack.webui.app import launch

    launch(
        args.host,
        args.port,
        auth,
        args.share_dir,
        args.lang,
        allow_dirs=args.allow_dir,
        allow_hosts=args.allow_host,
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "webui",
        help="the browser UI: a form for every training field, plan, start/stop/resume runs, chat, export",
        description=(
            "Gradio web UI (pip install 'lmstack[webui]'). The form is generated from the config schema; "
            "Start writes a YAML and runs `lmstack train` on it in a separate process, tracked under "
            "--share-dir so runs outlive the page. Binds 127.0.0.1 by default; any non-loopback address "
            "needs --auth or --auth-file."
        ),
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    who = p.add_mutually_exclusive_group()
    who.add_argument(
        "--auth", metavar="USER:PASS", help="require this login (visible in ps: prefer --auth-file)"
    )
    who.add_argument("--auth-file", metavar="FILE", help="require one of the user:password lines of FILE")
    p.add_argument(
        "--share-dir",
        default=DEFAULT_SHARE_DIR,
        help=f"where runs are tracked (run YAMLs, logs, exit codes; default ./{DEFAULT_SHARE_DIR})",
    )
    p.add_argument(
        "--lang", choices=["en", "zh"], default="en", help="initial language (switchable in the UI)"
    )
    p.add_argument(
        "--allow-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder Load/Save YAML may use besides the working folder (repeatable)",
    )
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a name requests may carry in Host and Origin besides localhost, 127.0.0.1, ::1 and the "
        "bound address (repeatable; '*' allows any): other names get HTTP 403, against DNS rebinding "
        "and cross-site pages",
    )
    p.set_defaults(func=cmd_webui)
