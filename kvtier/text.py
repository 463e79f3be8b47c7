"""Real English text available offline on any machine: Python standard library docstrings."""

from __future__ import annotations

import importlib
import inspect

MODULES = ("collections", "json", "argparse", "functools", "itertools", "pathlib", "subprocess", "threading",
           "logging", "unittest", "email.message", "http.client", "asyncio.tasks", "decimal", "fractions")


def stdlib_docstrings(modules: tuple[str, ...] = MODULES) -> list[str]:
    """Docstrings of the modules and their public classes and functions, in a fixed order."""
    out = []
    for name in modules:
        mod = importlib.import_module(name)
        for obj in [mod] + [getattr(mod, a) for a in sorted(dir(mod)) if not a.startswith("_")]:
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 200 and doc not in out:
                out.append(doc)
    return out


def stdlib_text(min_chars: int, skip: int = 0) -> str:
    """At least `min_chars` of prose, joined docstrings starting at the `skip`-th one."""
    docs = stdlib_docstrings()
    parts, total = [], 0
    for doc in docs[skip:] + docs[:skip]:
        parts.append(doc)
        total += len(doc)
        if total >= min_chars:
            break
    return "\n\n".join(parts)
