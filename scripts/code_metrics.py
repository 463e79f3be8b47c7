"""Size and shape of the package: lines per room, long files and functions, core feature branches,
the request path, paper words in the core, import cycles, and measurements left in comments.

    python scripts/code_metrics.py [ROOT]    # ROOT defaults to this checkout's kvtier/

Prints a table (used for the before/after of a re-cut); stdlib only. scripts/ and docs/ are read
beside ROOT.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import Counter
from pathlib import Path

REQUEST_PATH = ["engine/engine.py", "engine/scheduler.py", "engine/scheduler_api.py", "engine/block_pool.py",
                "engine/request.py", "engine/sampler.py", "engine/runner/model_runner.py"]
PAPER_WORDS = ["front", "dropped", "impress", "ellm", "cake", "hcache"]
NOT_PRODUCT = ("bench/", "cli/bench/", "testing/")
# A measured number: a number with a unit, a date, or an issue id (a constant's meaning, such as
# "64 tokens per chunk", matches too: the list is for reading, not a gate).
MEASURED = re.compile(r"\b\d[\d.,]*\s?(ms|us|µs|s|GB/s|MB/s|GiB|GB|MiB|MB|x|%|tokens?|tok/s)(?![\w/])"
                      r"|\b20\d\d-\d\d-\d\d\b|\bissues? \d+", re.IGNORECASE)


def room(path: Path, root: Path) -> str:
    parts = path.relative_to(root).parts
    if len(parts) == 1:
        return "(top)"
    if parts[0] == "engine" and len(parts) > 2:
        return f"engine/{parts[1]}"
    return parts[0]


def long_functions(tree: ast.AST, limit: int) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = (node.end_lineno or node.lineno) - node.lineno + 1
            if n > limit:
                out.append((n, node.name))
    return out


def code_lines(text: str) -> int:
    """Lines that are neither blank, comments nor docstrings."""
    doc: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            doc.update(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    return sum(1 for i, line in enumerate(text.splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and i not in doc)


def decisions(fn: ast.AST) -> int:
    """Branch points: if/elif, loops, conditional expressions, except clauses, match cases,
    comprehension conditions and each extra operand of and/or."""
    n = 0
    for node in ast.walk(fn):
        if isinstance(node, (ast.If, ast.IfExp, ast.For, ast.AsyncFor, ast.While, ast.ExceptHandler,
                             ast.match_case)):
            n += 1
        elif isinstance(node, ast.BoolOp):
            n += len(node.values) - 1
        elif isinstance(node, ast.comprehension):
            n += len(node.ifs)
    return n


def find(tree: ast.AST, cls: str, fn: str | None = None) -> ast.AST | None:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            if fn is None:
                return node
            return next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == fn), None)
    return None


def module_name(path: Path, root: Path) -> str:
    parts = (root.name, *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, text: str, root: Path, modules: set[str]) -> set[str]:
    """The package's modules a file imports at any depth (top level, in functions, TYPE_CHECKING):
    `from a import b` is an edge to a.b where b is a module, else to a."""
    me = module_name(path, root)
    pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return (out & modules) - {me}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                found.append(sorted([v, *comp]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def measured_comments(text: str) -> int:
    """Comments and docstrings lines that carry a measured number (see MEASURED)."""
    n = sum(1 for line in text.splitlines() if "#" in line and MEASURED.search(line.split("#", 1)[1]))
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            n += sum(1 for line in node.value.value.splitlines() if MEASURED.search(line))
    return n


def report_more(root: Path) -> None:
    files = sorted(root.rglob("*.py"))
    texts = {p: p.read_text() for p in files}
    rel = {p: p.relative_to(root).as_posix() for p in files}
    print("\nrequest path (lines / code lines):")
    total = [0, 0]
    for f in REQUEST_PATH:
        p = root / f
        n, c = (texts[p].count("\n"), code_lines(texts[p])) if p in texts else (0, 0)
        total = [total[0] + n, total[1] + c]
        print(f"  {n:5} {c:5} {f}")
    print(f"  {total[0]:5} {total[1]:5} total")
    runner = root / "engine/runner/model_runner.py"
    tree = ast.parse(texts.get(runner, ""))
    batch = find(tree, "StepBatch") or next((find(ast.parse(t), "StepBatch") for t in texts.values()
                                             if "class StepBatch" in t), None)
    fields = sum(isinstance(s, ast.AnnAssign) for s in batch.body) if isinstance(batch, ast.ClassDef) else 0
    upload = find(tree, "ModelRunner", "_upload")
    print(f"\nStepBatch fields: {fields}\ndecisions in ModelRunner._upload: {decisions(upload) if upload else 0}")
    print("paper words (lines naming each) in scheduler.py / model_runner.py:")
    for w in PAPER_WORDS:
        counts = [sum(w in line.lower() for line in texts.get(root / f, "").splitlines())
                  for f in ("engine/scheduler.py", "engine/runner/model_runner.py")]
        print(f"  {w:8} {counts[0]:4} {counts[1]:4}")
    product = [p for p in files if not rel[p].startswith(NOT_PRODUCT)]
    longf = sorted(((n, f"{rel[p]}:{name}") for p in product for n, name in long_functions(ast.parse(texts[p]), 60)),
                   reverse=True)
    print(f"\nproduct functions over 60 lines (without {', '.join(NOT_PRODUCT)}): {len(longf)}")
    for n, f in longf:
        print(f"  {n:5} {f}")
    modules = {module_name(p, root) for p in files}
    found = cycles({module_name(p, root): imports(p, texts[p], root, modules) for p in files})
    print(f"\nfile import cycles (top-level and lazy imports): {len(found)}")
    for c in found:
        print("  " + " <-> ".join(c))
    big = sorted(((texts[p].count("\n"), rel[p]) for p in files if texts[p].count("\n") > 400), reverse=True)
    print(f"\nfiles over 400 lines: {len(big)}")
    for n, f in big:
        print(f"  {n:5} {f}")
    scripts, bench_doc = root.parent / "scripts", root.parent / "docs" / "benchmarks.md"
    script_lines = sum(p.read_text().count("\n") for p in scripts.iterdir() if p.is_file()) if scripts.is_dir() else 0
    print(f"\nscripts/ lines: {script_lines}")
    print(f"docs/benchmarks.md lines: {bench_doc.read_text().count(chr(10)) if bench_doc.exists() else 0}")
    per_room: Counter[str] = Counter()
    for p in files:
        per_room[room(p, root)] += measured_comments(texts[p])
    print(f"\ncomment or docstring lines with measured numbers (heuristic): {sum(per_room.values())}")
    for r, n in sorted(per_room.items()):
        if n:
            print(f"  {r:22} {n:5}")


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1] / "kvtier"
    lines: Counter[str] = Counter()
    files: Counter[str] = Counter()
    big, longf = [], []
    for p in sorted(root.rglob("*.py")):
        text = p.read_text()
        n = text.count("\n")
        r = room(p, root)
        lines[r] += n
        files[r] += 1
        if n > 300:
            big.append((n, str(p.relative_to(root))))
        longf += [(k, f"{p.relative_to(root)}:{name}") for k, name in long_functions(ast.parse(text), 50)]
    print(f"{'room':22} {'files':>5} {'lines':>6}")
    for r in sorted(lines):
        print(f"{r:22} {files[r]:5} {lines[r]:6}")
    print(f"{'total':22} {sum(files.values()):5} {sum(lines.values()):6}")
    print(f"\nfiles over 300 lines: {len(big)}")
    for n, f in sorted(big, reverse=True):
        print(f"  {n:5} {f}")
    print(f"\nfunctions over 50 lines: {len(longf)}")
    for n, f in sorted(longf, reverse=True):
        print(f"  {n:5} {f}")
    # "is there a store / partial caching?" checks in the core's step: `self.X is (not) None`,
    # `if self.X:` and `... if self.X else ...` for the optional features' objects.
    feature = r"self\.(partial|fronts|store|link)"
    pattern = re.compile(rf"{feature} is (not )?None|if {feature}\s*(:|else)")
    hits = [f"engine/{p.name}:{i}" for p in sorted((root / "engine").glob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    print(f"\nfeature branches in engine/*.py: {len(hits)} {' '.join(hits)}")
    report_more(root)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
