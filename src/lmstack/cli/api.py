"""`lmstack api cfg.yaml [key=value ...] [--host H] [--port P] [--api-key K] [limits]`: an
OpenAI-compatible server (FastAPI + uvicorn) for the model (+ adapters) with the training template.
Limits: `--max-queue`, `--max-batch`, `--max-prompt-tokens`, `--max-tokens-limit`, `--max-request-tokens`,
`--read-timeout`, `--stall-timeout`; `--allow-host` for Host / Origin names beyond loopback and the bound
address (see `lmstack.infer.server` and `lmstack.infer.guard`)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def bind_address(host: str | None, port: int | None, env: dict) -> tuple[str, int]:
    """Flags win, then LLaMA-Factory's API_HOST / API_PORT, then loopback:8000 (LF users set these)."""
    host = host or env.get("API_HOST") or "127.0.0.1"
    if port is None:
        raw = env.get("API_PORT", "8000")
        if not raw.isdigit():
            from lmstack.config.errors import ConfigError

            raise ConfigError(f"API_PORT: got {raw!r}; give a port number")
        port = int(raw)
    return host, port


def cmd_api(args: argparse.Namespace) -> int:
    from lmstack.config.extras import require

    require("serve", "lmstack api")  # fastapi + uvicorn, before the model loads
    from lmstack.infer.engine import adapter_dirs, keep_unused_out, load_infer_config

    keep_unused_out(args.config, args.overrides)  # before transformers is imported
    from lmstack.infer.engines import check_backend, load_engine
    from lmstack.infer.limits import Limits, check_bind
    from lmstack.infer.server import serve

    args.host, args.port = bind_address(args.host, args.port, dict(os.environ))
    api_key = args.api_key or os.environ.get("API_KEY") or None
    check_bind(args.host, api_key)  # before the model loads
    hosts = [*args.allow_host, *filter(None, os.environ.get("API_ALLOWED_HOSTS", "").split(","))]
    limits = Limits(
        args.max_queue,
        args.max_prompt_tokens,
        args.max_tokens_limit,
        args.max_batch,
        tuple(args.image_dir),
        args.max_request_tokens,
        args.read_timeout,
        args.stall_timeout,
        tuple(h.strip() for h in hosts),
    )
    limits.check()
    cfg = load_infer_config(args.config, args.overrides)
    name = args.model_name or Path((adapter_dirs(cfg) or [cfg.model.model_name_or_path])[-1]).name
    check_backend(cfg)  # a missing vllm / sglang package is named before the model loads
    engine = load_engine(cfg, max_batch=limits.max_batch)
    serve(engine, args.host, args.port, api_key, name, limits)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from lmstack.infer.limits import MIN_KEY_CHARS, Limits

    p = sub.add_parser(
        "api",
        help="serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions)",
        description=(
            "OpenAI-compatible API: GET /v1/models, POST /v1/chat/completions and /v1/completions "
            "(stream or not; n, seed, stop, logprobs, response_format json_object, tools). Binds "
            "127.0.0.1 by default; any other address needs an API key of at least "
            f"{MIN_KEY_CHARS} characters (--api-key or API_KEY). max_new_tokens in the YAML is the "
            "default of a request's max_tokens. Concurrent requests are decoded together (continuous "
            "batching, up to --max-batch sequences); a client that disconnects stops its generation."
        ),
    )
    p.add_argument(
        "config",
        help="YAML config; a training YAML works: with adapter_name_or_path unset, the adapter or model "
        "trained in its output_dir is used (output_dir= on the command line: the base model)",
    )
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. max_new_tokens=512")
    p.add_argument("--host", help="address to bind (default: env API_HOST, else 127.0.0.1)")
    p.add_argument(
        "--port", type=int, help="port (default: env API_PORT, else 8000; 0 = any free port, printed)"
    )
    p.add_argument(
        "--api-key",
        help="require `Authorization: Bearer KEY` (default: env API_KEY; prefer API_KEY: a key given "
        "here is visible to every user of the machine in `ps`)",
    )
    p.add_argument(
        "--model-name", help="model id reported by /v1/models (default: the model/adapter folder name)"
    )
    defaults = Limits()
    p.add_argument(
        "--image-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder whose image files requests may name by path or file:// URL (repeatable; default: "
        "none, only data: URLs)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=defaults.max_queue,
        help="requests that may wait while --max-batch sequences generate; more get HTTP 503 with "
        f"Retry-After (default {defaults.max_queue})",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=defaults.max_batch,
        help=f"sequences decoded together (continuous batching; default {defaults.max_batch})",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=defaults.max_prompt_tokens,
        help="longest prompt in tokens, chat template included; longer ones get HTTP 400 (default "
        f"{defaults.max_prompt_tokens}; the model's context is a bound too)",
    )
    p.add_argument(
        "--max-tokens-limit",
        type=int,
        help="largest max_tokens a request may ask for; more gets HTTP 400 (default: the model's "
        "context; max_new_tokens of the YAML is the default of a request's max_tokens)",
    )
    p.add_argument(
        "--max-request-tokens",
        type=int,
        default=defaults.max_request_tokens,
        help="tokens one request may ask to generate, prompts x n x max_tokens; more gets HTTP 400 "
        f"(default {defaults.max_request_tokens}; a request's prompts x n is at most --max-batch too)",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=defaults.read_timeout,
        help="seconds a client has to send a request's headers, and again its body; a slower one is "
        f"disconnected (headers) or gets HTTP 408 (body) (default {defaults.read_timeout:g})",
    )
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=defaults.stall_timeout,
        help="seconds a stream may wait on a client that stops reading before it is dropped and its "
        f"place in the batch freed (default {defaults.stall_timeout:g})",
    )
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a name requests may carry in Host and Origin besides localhost, 127.0.0.1, ::1 and the "
        "bound address (repeatable; also env API_ALLOWED_HOSTS=a,b; '*' allows any): other names are "
        "refused with HTTP 403, against DNS rebinding and cross-site requests from web pages",
    )
    p.set_defaults(func=cmd_api)
