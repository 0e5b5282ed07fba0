"""No silent no-ops (DESIGN "The run plan"): every schema field is read somewhere in src/lmstack.

Static, with ast, over every module except config/schema.py. A field counts as read when its name is
- an attribute that is loaded anywhere (`x.field_name`; any object: the check is by name),
- a string constant given to getattr()/hasattr(), used as a dict key or as a subscript (`d["name"]`),
- a string of a literal tuple/list/set that a loop or comprehension walks with getattr(obj, loop_var)
  (`for name in ("pissa_init", ...): getattr(ft, name)`, also through a module-level constant),
- or a name built at run time (`getattr(ft, f"{kind}_target")`): those are listed in DYNAMIC below,
  each with the file that builds it and the pattern that file must contain.
Being read is necessary, not sufficient: the reader may still ignore the value on some path; that is
for the field's own tests (warning or refusal). This test catches a field nothing looks at at all.
"""

from __future__ import annotations

import ast
from pathlib import Path

from lmstack.config.schema import SECTIONS, field_owner

SRC = Path(__file__).resolve().parents[2] / "src" / "lmstack"
SCHEMA = SRC / "config" / "schema.py"

# field -> (file under src/lmstack that builds the name at run time, the exact source text that builds it).
# Keep it small: a field that is also read by its plain name must not be listed (the test says so).
DYNAMIC = {
    "galore_target": ("train/optimizers.py", 'getattr(ft, f"{kind}_target")'),  # kind: galore | apollo
    "apollo_target": ("train/optimizers.py", 'getattr(ft, f"{kind}_target")'),
    "galore_layerwise": ("train/optimizers.py", 'getattr(ft, f"{kind}_layerwise")'),
    "apollo_layerwise": ("train/optimizers.py", 'getattr(ft, f"{kind}_layerwise")'),
}

# Unread on the code this test was written against (issue 16); remove the xfail once each has a
# consumer, a documented warning when it has no effect, or a refusal.
UNREAD_TODAY: list[str] = []  # issue 16 gave the last five a consumer, a warning or a refusal


def _is_getattr(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr")
    )


def _strings(node: ast.AST | None) -> list[str]:
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def _looped_names(tree: ast.Module) -> set[str]:
    """Strings of literal collections walked by a loop whose body calls getattr(obj, <loop variable>)."""
    constants = {
        t.id: n.value
        for n in tree.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    found: set[str] = set()
    loops = [(n.target, n.iter, n) for n in ast.walk(tree) if isinstance(n, ast.For)]
    loops += [
        (g.target, g.iter, n)
        for n in ast.walk(tree)
        if isinstance(n, ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp)
        for g in n.generators
    ]
    for target, iterable, scope in loops:
        if not isinstance(target, ast.Name):
            continue
        if isinstance(iterable, ast.Name):
            iterable = constants.get(iterable.id)
        names = _strings(iterable)
        uses = any(
            _is_getattr(c) and isinstance(c.args[1], ast.Name) and c.args[1].id == target.id
            for c in ast.walk(scope)
            if _is_getattr(c) and len(c.args) >= 2
        )
        if names and uses:
            found.update(names)
    return found


def names_read(files: list[Path]) -> set[str]:
    read: set[str] = set()
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                read.add(node.attr)
            elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Attribute):
                read.add(node.target.attr)  # `x.f += 1` reads x.f
            elif _is_getattr(node) and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                read.add(node.args[1].value)
            elif isinstance(node, ast.Dict):
                read.update(k.value for k in node.keys if isinstance(k, ast.Constant))
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                read.add(node.slice.value)
        read |= _looped_names(tree)
    return read


def source_files() -> list[Path]:
    return [p for p in sorted(SRC.rglob("*.py")) if p != SCHEMA]


def test_the_walk_sees_the_schema_and_the_reading_patterns(tmp_path):
    fields = field_owner()
    assert len(fields) == sum(len(cls.model_fields) for cls in SECTIONS.values()) > 100
    sample = tmp_path / "sample.py"
    sample.write_text(
        "X = ('via_constant',)\n"
        "def f(cfg, ft, d):\n"
        "    cfg.training.plain_attr\n"
        "    cfg.training.written = 1\n"
        "    getattr(ft, 'by_getattr')\n"
        "    d['by_subscript']\n"
        "    {'by_dict_key': 1}\n"
        "    [n for n in ('via_loop',) if getattr(ft, n)]\n"
        "    [n for n in X if getattr(ft, n)]\n"
        "    for n in ('listed_only',):\n"
        "        print(n)\n"
        "    'bare_string'\n"
    )
    read = names_read([sample])
    for name in ("plain_attr", "by_getattr", "by_subscript", "by_dict_key", "via_loop", "via_constant"):
        assert name in read, name
    for name in ("written", "listed_only", "bare_string"):
        assert name not in read, name


def test_dynamic_table_is_real_and_minimal():
    fields = field_owner()
    direct = names_read(source_files())
    for field, (rel, pattern) in DYNAMIC.items():
        assert field in fields, f"DYNAMIC lists {field}, which is not a schema field: remove it"
        text = (SRC / rel).read_text(encoding="utf-8")
        assert pattern in text, f"DYNAMIC: {rel} no longer contains {pattern!r} (the consumer of {field})"
        assert field not in direct, f"DYNAMIC: {field} is read by name now; remove it from the table"


def unread_fields() -> list[str]:
    read = names_read(source_files()) | set(DYNAMIC)
    return sorted(name for name in field_owner() if name not in read)


def test_no_field_unread_beyond_the_known_list():
    """Guards today: a newly unread field fails now, and a fixed one must leave UNREAD_TODAY."""
    unread = unread_fields()
    new = [f for f in unread if f not in UNREAD_TODAY]
    assert not new, (
        f"newly unread schema field(s): {', '.join(new)}; give each a consumer, a warning or a refusal"
    )
    fixed = [f for f in UNREAD_TODAY if f not in unread]
    assert not fixed, f"read now: {', '.join(fixed)}; remove them from UNREAD_TODAY"


def test_every_schema_field_has_a_consumer():
    owner = field_owner()
    unread = [f"{name} ({owner[name]})" for name in unread_fields()]
    assert not unread, (
        f"{len(unread)} schema field(s) that nothing in src/lmstack reads (config/schema.py aside): "
        f"{', '.join(unread)}. A field accepted and ignored breaks lmstack's promise: give each a "
        "consumer, a documented warning when it has no effect on this path, or a refusal that says the "
        "feature is not available (ConfigError before the model loads)."
    )
