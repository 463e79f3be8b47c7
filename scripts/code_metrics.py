"""Size and shape of the package: lines per room, long files and functions, core feature branches.

    python scripts/code_metrics.py [ROOT]    # ROOT defaults to this checkout's kvtier/

Prints a table (used for the before/after of a re-cut); stdlib only.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import Counter
from pathlib import Path


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
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
