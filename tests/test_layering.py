"""The rooms of the package and what each may import (docs/architecture.md draws the map).

    models, store                 know nothing of the engine, planning or anything above
    planning                      pure and torch-free: plain values in, plain values out
    engine core                   scheduler, block pool, request, config, sampler, detokenizer:
                                  never the rooms beside it (runner, link, restore, calibrate, partial)
    engine/runner                 step tensors and host/device copies; never the link or the executors
    engine/restore                executors applying a Plan; never the link, nor a paper's room
    engine/impress                IMPRESS (importance-only, lossy): one room; never the link
    engine/link                   engine <-> store; never the facade
    engine/calibrate              measure once and cache; never the link
    engine.py, factory.py         the facade that wires the rooms
    serve, cli, bench             on top; only bench (and the tests) may use kvtier.testing

Pure modules import without torch or numpy, so their logic is reasoned about and tested as plain
values. Each import check runs in a fresh interpreter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvtier"

TORCH_FREE = [
    "kvtier.engine.scheduler", "kvtier.engine.scheduler_api", "kvtier.engine.block_pool", "kvtier.engine.request", "kvtier.engine.link.sessions",
    "kvtier.planning.planner", "kvtier.planning.plan", "kvtier.planning.optimizer", "kvtier.planning.costs", "kvtier.planning.truncation",
    "kvtier.store.keys", "kvtier.store.index", "kvtier.store.policy", "kvtier.store.lookahead",
    "kvtier.store.layout", "kvtier.store.spec", "kvtier.dtypes", "kvtier.paths",
]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_pure_modules_import_without_torch(module):
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('numpy')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"{module} pulls in {out.stdout.strip()}"


def test_planning_is_torch_free_throughout():
    """Every planning module imports without torch (numpy is allowed where a module fits data)."""
    mods = sorted(f"kvtier.planning.{p.stem}" for p in (PACKAGE / "planning").glob("*.py") if p.stem != "__init__")
    code = f"import sys, {', '.join(mods)}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", f"one of {mods} pulls in torch"


def _imports(path: Path) -> set[str]:
    """Every kvtier module a source file imports (absolute or relative, at any depth)."""
    tree = ast.parse(path.read_text())
    pkg = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([node.module] if node.module else []))
                found.add(base)
                found |= {f"{base}.{a.name}" for a in node.names}  # `from . import format` names a module
            elif node.module:
                found.add(node.module)
                found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m.startswith("kvtier")}


ABOVE_ENGINE = ("kvtier.serve", "kvtier.bench", "kvtier.cli", "kvtier.testing")
BESIDE_CORE = ("kvtier.engine.runner", "kvtier.engine.link", "kvtier.engine.restore", "kvtier.engine.calibrate",
               "kvtier.engine.partial", "kvtier.engine.impress", "kvtier.engine.engine", "kvtier.engine.factory", "kvtier.engine.background")
CORE = [f"engine/{m}.py" for m in ("scheduler", "scheduler_api", "block_pool", "request", "config", "sampler", "detokenizer")]

# files (globs under kvtier/) -> module prefixes they must never import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "models/**/*.py": ("kvtier.engine", "kvtier.planning", "kvtier.store") + ABOVE_ENGINE,
    "store/**/*.py": ("kvtier.engine", "kvtier.planning", "kvtier.models") + ABOVE_ENGINE,
    "planning/**/*.py": ("kvtier.engine", "kvtier.models") + ABOVE_ENGINE,
    **{core: BESIDE_CORE + ABOVE_ENGINE for core in CORE},
    "engine/runner/**/*.py": ("kvtier.engine.link", "kvtier.engine.restore", "kvtier.engine.calibrate",
                           "kvtier.engine.partial", "kvtier.engine.impress", "kvtier.engine.engine",
                           "kvtier.engine.factory", "kvtier.engine.scheduler") + ABOVE_ENGINE,
    "engine/restore/*.py": ("kvtier.engine.link", "kvtier.engine.calibrate", "kvtier.engine.partial",
                            "kvtier.engine.impress", "kvtier.engine.engine", "kvtier.engine.factory") + ABOVE_ENGINE,
    "engine/impress/*.py": ("kvtier.engine.link", "kvtier.engine.calibrate", "kvtier.engine.partial",
                            "kvtier.engine.engine", "kvtier.engine.factory", "kvtier.engine.scheduler") + ABOVE_ENGINE,
    "engine/link/*.py": ("kvtier.engine.engine", "kvtier.engine.factory", "kvtier.engine.partial") + ABOVE_ENGINE,
    "engine/calibrate/*.py": ("kvtier.engine.link", "kvtier.engine.partial", "kvtier.engine.engine",
                              "kvtier.engine.factory") + ABOVE_ENGINE,
    "engine/partial.py": ("kvtier.engine.link", "kvtier.engine.restore", "kvtier.engine.engine") + ABOVE_ENGINE,
    "engine/*.py": ABOVE_ENGINE,
    "serve/*.py": ("kvtier.cli", "kvtier.bench", "kvtier.testing"),
    "cli/**/*.py": ("kvtier.testing",),
    "bench/**/*.py": ("kvtier.cli",),
    "testing/*.py": ("kvtier.cli", "kvtier.bench", "kvtier.serve"),
    "*.py": ("kvtier.testing",),
}
ENTRY_POINTS = {"__main__.py"}  # `python -m kvtier.serve` may reach up to the CLI that parses its options


@pytest.mark.parametrize("pattern", sorted(FORBIDDEN))
def test_dependencies_point_one_way(pattern):
    bad = []
    files = sorted(PACKAGE.glob(pattern))
    assert files, f"{pattern} matches no file: update the map"
    for path in files:
        if path.name in ENTRY_POINTS:
            continue
        for mod in _imports(path):
            if mod.startswith(FORBIDDEN[pattern]):
                bad.append(f"{path.relative_to(PACKAGE.parent)} imports {mod}")
    assert not bad, "\n".join(bad)


def test_the_import_check_sees_imports():
    """The checker itself: it finds absolute, relative and function-level imports."""
    found = _imports(PACKAGE / "store" / "tiered.py")
    assert {"kvtier.store.format", "kvtier.store.tiers.redis_tier"} <= found
    assert "kvtier.engine.restore.layerwise" in _imports(PACKAGE / "engine" / "link" / "restorer.py")
    assert "kvtier.engine.factory" in _imports(PACKAGE / "cli" / "engine_args.py")  # inside a function


def test_the_map_covers_every_file():
    """A new room gets a rule: every module of the package falls under some pattern."""
    covered = {p for pattern in FORBIDDEN for p in PACKAGE.glob(pattern)}
    missing = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p not in covered]
    assert not missing, f"no layering rule for {missing}"


def _is_module(name: str) -> bool:
    parts = name.split(".")
    return (PACKAGE.parent.joinpath(*parts).with_suffix(".py").exists()
            or PACKAGE.parent.joinpath(*parts, "__init__.py").exists())


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _file_imports(path: Path) -> set[str]:
    """The kvtier modules a file imports, at any depth: `from a import b` is an edge to the module
    a.b where b is a submodule, else to a (whose __init__ then runs for b)."""
    pkg = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base)
    return {m for m in found if m.startswith("kvtier") and _is_module(m)}


def import_cycles() -> list[list[str]]:
    """The package's file import cycles (top-level, function-level and TYPE_CHECKING imports alike)."""
    return cycles_of({_module_name(p): _file_imports(p) - {_module_name(p)} for p in PACKAGE.rglob("*.py")})


def cycles_of(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


KNOWN_CYCLES: list[list[str]] = []


def test_no_import_cycles():
    """No two files import each other, directly or around a loop, at any depth of the file (a lazy
    import inside a function is still a dependency: the two files cannot be understood apart)."""
    cycles = [c for c in import_cycles() if c not in KNOWN_CYCLES]
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_sees_cycles():
    """The checker itself: loops of any length are found, a chain into one is not part of it, and
    `from pkg import submodule` is an edge to the submodule."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": {"f"}}
    assert cycles_of(graph) == [["a", "b", "c"], ["d", "e"]]
    assert "kvtier.cli.engine_args" in _file_imports(PACKAGE / "cli" / "store.py")
    assert "kvtier.engine.factory" in _file_imports(PACKAGE / "cli" / "engine_args.py")  # inside a function
