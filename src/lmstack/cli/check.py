"""`lmstack check cfg.yaml [key=value ...] [--strict] [--json]`: validate the training data.

Loads the tokenizer (never the model weights) and the datasets, prints per-dataset counts, token
length percentiles, truncation, trainable tokens, every problem (file, record/line, field, reason)
and one training example with the trained tokens marked; writes data_report.json into output_dir
(or the current directory when output_dir is not set).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

logger = logging.getLogger(__name__)
REPORT_NAME = "data_report.json"


def run_check(config: str | None, overrides: list[str] | dict | None = None) -> tuple[dict, Path]:
    """Returns (report, path of data_report.json)."""
    from lmstack.config.load import build_config, load_yaml, parse_overrides
    from lmstack.data.validate import check_data
    from lmstack.models.load import load_tokenizer
    from lmstack.templates import get_template

    flat = load_yaml(config) if config is not None else {}
    flat.update(overrides if isinstance(overrides, dict) else parse_overrides(list(overrides or [])))
    out_dir = Path(flat["output_dir"]) if flat.get("output_dir") else Path.cwd()  # where the report goes
    if not flat.get("output_dir"):  # no training output to guard: the run plan gets a name no folder has
        from lmstack.infer.trained import NO_OUTPUT_DIR

        flat["output_dir"] = NO_OUTPUT_DIR
    cfg = build_config(flat)
    from lmstack.train.run import plan_run

    plan, _ = plan_run(cfg, launch=False)  # refuses what `lmstack train` refuses, before any tokenizing
    logger.info("%s", plan.describe())
    cfg = plan.cfg
    tokenizer = load_tokenizer(cfg)
    template = get_template(
        cfg.data.template,
        tokenizer,
        thinking_style=cfg.data.thinking_style,
        escape_content=cfg.data.escape_special_tokens_in_content,
    )
    for note in template.fix_tokenizer(tokenizer):
        logger.info(note)
    report = check_data(cfg, tokenizer, template, pt_split=plan.split_long_texts)
    report["run_plan"] = plan.to_dict()
    report["strict"] = cfg.data.strict  # `strict: true` in the YAML: --strict's meaning
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / REPORT_NAME
    path.write_text(json.dumps(report, indent=2, ensure_ascii=False), encoding="utf-8")
    return report, path


def cmd_check(args: argparse.Namespace) -> int:
    from lmstack.data.validate import format_report

    report, path = run_check(args.config, args.overrides)
    if args.json:
        print(json.dumps(report, indent=2, ensure_ascii=False))
    else:
        print(format_report(report, color=sys.stdout.isatty()))
        print(f"\nreport written to {path}")
    problems = report["totals"]["problems"]
    if (args.strict or report["strict"]) and problems:
        print(f"--strict: {problems} problem(s) found", file=sys.stderr)
        return 1
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "check",
        help="validate the training data: counts, token lengths, problems, a rendered example",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", help="training YAML")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.add_argument("--strict", action="store_true", help="exit with status 1 on any problem")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_check)
