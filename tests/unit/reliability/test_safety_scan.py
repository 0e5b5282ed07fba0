"""Static scan of src/: no unpickling, no unsafe YAML, no shell strings, no eval/exec."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[3] / "src" / "lmstack"


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    return ""


def _kw(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def problems_in(tree: ast.AST, where: str) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _name(node.func)
        line = f"{where}:{node.lineno}"
        if name in ("pickle.load", "pickle.loads", "cPickle.load", "dill.load", "marshal.loads"):
            found.append(f"{line}: {name}")
        elif name in ("eval", "exec"):
            found.append(f"{line}: {name}()")
        elif name == "torch.load":
            flag = _kw(node, "weights_only")
            if not (isinstance(flag, ast.Constant) and flag.value is True):
                found.append(f"{line}: torch.load without weights_only=True")
        elif name in ("yaml.load", "yaml.load_all", "yaml.unsafe_load", "yaml.full_load"):
            loader = _kw(node, "Loader")
            if name != "yaml.load" or "Safe" not in _name(loader or ast.Name(id="")):
                found.append(f"{line}: {name} without a SafeLoader")
        elif name.startswith("subprocess.") or name in ("os.system", "os.popen"):
            shell = _kw(node, "shell")
            if name in ("os.system", "os.popen") or (isinstance(shell, ast.Constant) and shell.value):
                found.append(f"{line}: {name} runs a shell string")
    return found


def test_scanner_catches_each_pattern():
    bad = """
import pickle, torch, yaml, subprocess, os
pickle.load(f); eval("1"); torch.load(p); torch.load(p, weights_only=False)
yaml.load(s); yaml.load(s, Loader=yaml.FullLoader); subprocess.run("ls", shell=True); os.system("ls")
"""
    assert len(problems_in(ast.parse(bad), "x")) == 8
    good = "import torch, yaml\ntorch.load(p, weights_only=True)\nyaml.load(s, Loader=yaml.SafeLoader)\n"
    assert problems_in(ast.parse(good), "x") == []


def test_src_has_no_unsafe_deserialization_or_shell_strings():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        found += problems_in(ast.parse(path.read_text(encoding="utf-8")), str(path.relative_to(SRC)))
    assert found == []
