"""Outside kvtier/engine, the engine is used through its public API: `Engine.stats()` for its queues,
pool and preemptions, `Engine.store` for the store's own statistics. Nothing above it reads the
scheduler, the block pool, the runner, the store link, the output assembly or a private attribute:
those belong to the step thread and change shape with the engine (test_layering.py checks imports;
this checks attribute reads)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kvtier"

INTERNALS = {"scheduler", "pool", "runner", "link", "outputs"}


def _is_engine(node: ast.expr) -> bool:
    """An expression naming an engine: `engine`, `eng`, `self.engine`, `ctx.engine`, `llm_engine`..."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name in ("eng", "core") or name.endswith("engine")


def reach_ins(source: str) -> list[tuple[int, str]]:
    """(line, `<engine>.<attribute>`) for each read of an engine internal in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _is_engine(node.value):
            attr = node.attr
            if attr in INTERNALS or (attr.startswith("_") and not attr.startswith("__")):
                found.append((node.lineno, f"{ast.unparse(node.value)}.{attr}"))
    return found


def test_nothing_outside_the_engine_reads_its_internals():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if (PACKAGE / "engine") in path.parents:
            continue
        bad += [f"{path.relative_to(PACKAGE.parent)}:{line}: {what}" for line, what in reach_ins(path.read_text())]
    assert not bad, "read Engine.stats() / Engine.store instead:\n" + "\n".join(bad)


def test_the_reach_in_check_sees_reach_ins():
    src = ("sched = engine.scheduler\nn = ctx.engine.pool.num_free\ns = eng.link.store\n"
           "x = self.engine._live\nok = engine.stats().running\nfine = engine.model.name\n")
    assert [what for _, what in sorted(reach_ins(src))] == ["engine.scheduler", "ctx.engine.pool", "eng.link",
                                                    "self.engine._live"]


def test_the_placement_policy_is_torch_free():
    code = "import sys, kvtier.engine.placement; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
