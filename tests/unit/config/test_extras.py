"""The extras table (config/extras.py) that the pre-load checks read agrees with pyproject.toml and
the README: every extra exists in both, and each module it checks is installed by a package the
extra lists."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest

from lmstack.config.errors import ConfigError
from lmstack.config.extras import EXTRAS, install_line, require

REPO = Path(__file__).resolve().parents[3]
OPTIONAL = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]


GPU_ONLY = {"vllm", "sglang", "unsloth"}


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_every_extra_is_in_pyproject_and_the_readme(extra):
    assert extra in OPTIONAL, extra
    readme = (REPO / "README.md").read_text()
    assert f"| `{extra}` |" in readme and f"`{install_line(extra)}`" in readme
    if extra in GPU_ONLY:  # CUDA-only engines: CI (no GPU) tests their refusals, not the packages
        assert not _names(OPTIONAL[extra]) & _names(OPTIONAL["dev"])
    else:
        assert _names(OPTIONAL[extra]) <= _names(OPTIONAL["dev"])  # CI installs and tests it


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_each_checked_module_comes_from_a_package_the_extra_lists(extra):
    dists = importlib.metadata.packages_distributions()
    for module in EXTRAS[extra].modules:
        if module not in dists:
            pytest.skip(f"{module} not installed here")
        owners = {d.lower().replace("_", "-") for d in dists[module]}
        assert owners & _names(OPTIONAL[extra]), (extra, module, owners)


def test_trackers_group_has_every_tracker_extra():
    from lmstack.config.schema import TRACKERS

    assert _names(OPTIONAL["trackers"]) == set().union(*(_names(OPTIONAL[t]) for t in TRACKERS))


def test_require_names_what_needs_it_and_the_install_line(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # unimportable, as if not installed
    with pytest.raises(ConfigError, match=r"^lmstack api needs `uvicorn`, which is not installed; pip install "
                       r"'lmstack\[serve\]'$"):  # fmt: skip
        require("serve", "lmstack api")
