"""The package's walls (DESIGN "The run plan"): no import circles, no import pointing up a floor,
process topology read from the environment only in launch/, and no unconverted Config travelling
through the code that the run plan now owns."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "lmstack"

# lowest floor first; a module may import its own floor and the floors below it
FLOORS = [
    ("memory",),
    ("config",),
    ("launch",),
    ("templates",),
    ("data",),
    ("models",),
    ("plan",),
    ("reliability",),
    ("infer",),
    ("train",),
    ("cli", "webui", "tiny", "tiny_vision", "tiny_vl"),
]
TOPOLOGY_VARS = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "NNODES",
    "NPROC_PER_NODE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "FORCE_TORCHRUN",
    "USE_RAY",
    "ACCELERATE_USE_FSDP",
    "FSDP_SHARDING_STRATEGY",
    "FSDP_VERSION",
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _runtime_imports(tree: ast.AST, type_only: bool = False) -> list[ast.AST]:
    """Import nodes; `if TYPE_CHECKING:` blocks (annotations only, never executed) skipped unless
    `type_only` (a type-only circle is a circle too)."""
    found: list[ast.AST] = []

    def visit(node: ast.AST) -> None:
        if not type_only and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph(type_only: bool = False) -> dict[str, set[str]]:
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for node in _runtime_imports(ast.parse(path.read_text()), type_only):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lmstack"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    targets.append(full if full in mods else node.module)
            elif isinstance(node, ast.Import):
                targets += [a.name for a in node.names if a.name.startswith("lmstack")]
            edges[name] |= {t for t in targets if t in mods and t != name}
    return edges


def _floor(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None  # lmstack/__init__
    for level, names in enumerate(FLOORS):
        if parts[1] in names:
            return level
    raise AssertionError(f"{module}: its package is on no floor; add it to FLOORS in {__file__}")


def test_no_import_circles() -> None:
    edges = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in edges:
        if v not in index:
            strongconnect(v)
    assert not cycles, f"import circles: {cycles}"


def test_no_import_points_up_a_floor() -> None:
    upward = []
    for src, targets in _graph().items():
        a = _floor(src)
        for dst in targets:
            b = _floor(dst)
            if a is not None and b is not None and b > a:
                upward.append(f"{src} -> {dst}")
    assert not upward, (
        "imports that point up a floor (floors: "
        + " < ".join("/".join(f) for f in FLOORS)
        + "):\n"
        + "\n".join(sorted(upward))
    )


def _env_reads(tree: ast.AST) -> list[str]:
    """Topology variable names read through os.environ[...] / os.environ.get(...) / os.getenv(...)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and "environ" in ast.unparse(node.value):
            key = node.slice
            if isinstance(key, ast.Constant):
                names.append(str(key.value))
        if isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            if func.endswith(("environ.get", "getenv", "env.get")) and node.args:
                if isinstance(node.args[0], ast.Constant):
                    names.append(str(node.args[0].value))
    return [n for n in names if n in TOPOLOGY_VARS]


def test_topology_is_read_only_in_launch() -> None:
    offenders = []
    for name, path in _modules().items():
        if name.startswith("lmstack.launch."):
            continue
        reads = _env_reads(ast.parse(path.read_text()))
        if reads:
            offenders.append(f"{name}: {sorted(set(reads))}")
    assert not offenders, "topology read outside launch/ (use LaunchContext / the run plan):\n" + "\n".join(
        offenders
    )


def test_run_decisions_are_not_re_derived() -> None:
    """The decisions the plan owns are not re-derived from the config elsewhere."""
    patterns = {
        "packing_enabled(": "plan.packing",
        "decide.row_capacity(": "plan.row_capacity",
        "attention_implementation(cfg": "plan.attention",
        "master_weights_mode(": "plan.precision.master_weights",
        "deepspeed_zero_stage(": "plan.zero_stage",
        "fsdp_requested(": "plan.fsdp",
        "json.loads(Path(cfg.training.deepspeed)": "plan.deepspeed",
        "cfg.training.master_weights =": "plan.precision",
        "setattr(cfg.training": "RunPlan.resolve (auto fields)",
    }
    found = []
    for name, path in _modules().items():
        text = path.read_text()
        for pattern, owner in patterns.items():
            if pattern in text and not name.startswith(
                ("lmstack.plan.decide", "lmstack.plan.runplan", "lmstack.launch.")
            ):
                found.append(f"{name}: {pattern!r} (read {owner})")
    assert not found, "\n".join(found)


def test_memory_imports_nothing_else_of_lmstack() -> None:
    """lmstack.memory is the ground floor: stdlib, torch/transformers/accelerate only (the resolver in
    plan/ computes everything it needs from the config, model folder and data)."""
    outside = [
        f"{src} -> {dst}"
        for src, targets in _graph(type_only=True).items()
        if src.startswith("lmstack.memory")
        for dst in targets
        if not dst.startswith("lmstack.memory")
    ]
    assert not outside, "\n".join(sorted(outside))


def test_vision_model_types_match_models_vision() -> None:
    from lmstack.memory.model_spec import VISION_MODEL_TYPES
    from lmstack.models.vision import COMPOSITE

    assert set(COMPOSITE) == VISION_MODEL_TYPES
