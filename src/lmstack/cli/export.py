"""`lmstack export cfg.yaml [key=value ...]`: merge adapters into the base and save a plain model."""

from __future__ import annotations

import argparse


def cmd_export(args: argparse.Namespace) -> int:
    from lmstack.infer.engine import keep_unused_out

    keep_unused_out(args.config, args.overrides)  # before transformers is imported
    from lmstack.infer.export import export

    out = export(args.config, args.overrides)
    print(f"exported to {out}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="merge LoRA adapters into the base, save safetensors + tokenizer + chat template + Modelfile",
        description=(
            "Merge adapter_name_or_path (comma-separated, in order; unset on a training YAML: the adapter "
            "in output_dir) into model_name_or_path, cast to "
            "infer_dtype and save into export_dir (shards of export_size GB), with the tokenizer, a chat "
            "template rendering the training template, and an Ollama Modelfile."
        ),
    )
    p.add_argument(
        "config",
        help="YAML config; a training YAML works: with adapter_name_or_path unset, the adapter or model "
        "trained in its output_dir is used (output_dir= on the command line: the base model)",
    )
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. export_dir=merged")
    p.set_defaults(func=cmd_export)
