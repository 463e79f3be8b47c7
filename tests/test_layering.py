"""Dependencies point one way: models, store <- restore <- engine <- serve, bench, cli.

The pure modules (scheduler, block pool, planner, plan, costs, store keys, index and policies)
import without torch, so their logic can be reasoned about and tested as plain values; `store`
and `models` never import `engine` or `restore`. Each check runs in a fresh interpreter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvtier"

TORCH_FREE = [
    "kvtier.engine.scheduler", "kvtier.engine.block_pool", "kvtier.engine.request", "kvtier.engine.link.sessions",
    "kvtier.planning.planner", "kvtier.planning.plan", "kvtier.planning.costs", "kvtier.planning.truncation",
    "kvtier.store.keys", "kvtier.store.index", "kvtier.store.policy", "kvtier.store.lookahead",
    "kvtier.store.layout", "kvtier.store.spec", "kvtier.dtypes", "kvtier.paths",
]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_pure_modules_import_without_torch(module):
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('numpy')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"{module} pulls in {out.stdout.strip()}"


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


# package -> packages it must never import
FORBIDDEN = {
    "models": ("kvtier.engine", "kvtier.restore", "kvtier.store", "kvtier.serve", "kvtier.bench"),
    "store": ("kvtier.engine", "kvtier.restore", "kvtier.models", "kvtier.serve", "kvtier.bench"),
    "restore": ("kvtier.engine", "kvtier.models", "kvtier.serve", "kvtier.bench"),
    "engine": ("kvtier.serve", "kvtier.bench", "kvtier.cli.main"),
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_dependencies_point_one_way(package):
    bad = []
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for mod in _imports(path):
            if mod.startswith(FORBIDDEN[package]):
                bad.append(f"{path.relative_to(PACKAGE.parent)} imports {mod}")
    assert not bad, "\n".join(bad)


def test_the_import_check_sees_imports():
    """The checker itself: it finds absolute, relative and function-level imports."""
    found = _imports(PACKAGE / "store" / "tiered.py")
    assert {"kvtier.store.format", "kvtier.store.tiers.redis_tier"} <= found
    assert "kvtier.engine.restore.layerwise" in _imports(PACKAGE / "engine" / "restorer.py")
