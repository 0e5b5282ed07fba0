"""The API key's safer channel is documented where users look: `lmstack api --help` and the README
both recommend the API_KEY environment variable over `--api-key`, whose value `ps` shows."""

from __future__ import annotations

import re
from pathlib import Path

from lmstack.cli.main import build_parser

README = Path(__file__).resolve().parents[2] / "README.md"


def test_api_help_and_readme_recommend_the_environment_variable():
    api = next(a for a in build_parser()._subparsers._group_actions[0].choices.items() if a[0] == "api")[1]
    help_text = " ".join(api.format_help().split())
    assert "prefer API_KEY" in help_text and "`ps`" in help_text
    assert re.search(
        r"prefer `API_KEY` in the environment over `--api-key`, which `ps` shows", README.read_text()
    )
