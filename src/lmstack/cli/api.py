"""`lmstack api cfg.yaml [key=value ...] [--host H] [--port P] [--api-key K]`: an OpenAI-compatible
server (FastAPI + uvicorn) for the model (+ adapters) with the training template."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def cmd_api(args: argparse.Namespace) -> int:
    from lmstack.infer.engine import ChatEngine, adapter_dirs, load_infer_config
    from lmstack.infer.server import check_bind, serve

    api_key = args.api_key or os.environ.get("API_KEY") or None
    check_bind(args.host, api_key)  # before the model loads
    cfg = load_infer_config(args.config, args.overrides)
    name = args.model_name or Path((adapter_dirs(cfg) or [cfg.model.model_name_or_path])[-1]).name
    engine = ChatEngine.from_config(cfg)
    serve(engine, args.host, args.port, api_key, name)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "api",
        help="serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions)",
        description=(
            "OpenAI-compatible API: GET /v1/models, POST /v1/chat/completions (stream or not). Binds "
            "127.0.0.1 by default; any other address needs an API key (--api-key or API_KEY). "
            "max_new_tokens in the YAML is the default and the upper bound of a request's max_tokens."
        ),
    )
    p.add_argument(
        "config",
        help="YAML config; a training YAML works: with adapter_name_or_path unset, the adapter or model "
        "trained in its output_dir is used (output_dir= on the command line: the base model)",
    )
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. max_new_tokens=512")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port, printed)")
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` (default: env API_KEY)")
    p.add_argument(
        "--model-name", help="model id reported by /v1/models (default: the model/adapter folder name)"
    )
    p.set_defaults(func=cmd_api)
