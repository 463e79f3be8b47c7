"""kvtier's benchmarks (`kvtier bench ...`): the evidence behind docs/benchmarks.md.

Their own libraries (matplotlib for figures, httpx for `bench load`'s client) are the `kvtier[bench]`
extra, not dependencies of a plain install.
"""

from __future__ import annotations

BENCH_EXTRA = ("matplotlib", "httpx")  # pyproject.toml's [project.optional-dependencies] bench
INSTALL_HINT = "pip install 'kvtier[bench]'"


def missing_extra(error: ModuleNotFoundError, what: str = "this benchmark") -> SystemExit | None:
    """The one-line exit for a bench whose extra library is not installed (None: another import failed)."""
    name = (error.name or "").partition(".")[0]
    if name not in BENCH_EXTRA:
        return None
    return SystemExit(f"{what} needs {name}, which a plain install leaves out: {INSTALL_HINT}")
