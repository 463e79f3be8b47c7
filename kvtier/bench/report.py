"""The one table writer and plot helper of every benchmark (markdown and rich tables, figures).

Each benchmark decides its columns and cells; how a table or a figure file is written lives here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def markdown_rows(head: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    """A markdown table: the header, the separator, one line per row."""
    return (["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            + ["| " + " | ".join(cells) + " |" for cells in body])


def goal_rows(goals: Sequence[dict], numbers: str = "numbers") -> list[str]:
    """The goals as a markdown table (goal, met, the goal's `summary`), after a blank line; none: []."""
    if not goals:
        return []
    return [""] + markdown_rows(["goal", "met", numbers], [[g["goal"], "yes" if g["met"] else "**no**", g["summary"]]
                                                          for g in goals])


def markdown_table(rows: list[tuple[str, str]]) -> str:
    """A two-column (metric, value) markdown table, the metric column padded to one width."""
    width = max(len(k) for k, _ in rows)
    lines = [f"| {'metric'.ljust(width)} | value |", f"|{'-' * (width + 2)}|-------|"]
    return "\n".join(lines + [f"| {k.ljust(width)} | {v} |" for k, v in rows])


def rich_table(title: str, head: Sequence[str], body: Sequence[Sequence[str]], right: Sequence[str] = ()) -> Any:
    """A rich Table (terminal output) of the same cells a markdown table would hold."""
    from rich.table import Table

    t = Table(title=title)
    for c in head:
        t.add_column(c, justify="right" if c in right else "left")
    for cells in body:
        t.add_row(*cells)
    return t


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} ms"


def mib(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} MiB"


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend (benchmarks run headless); without matplotlib
    (a plain install), one line naming the `kvtier[bench]` extra and exit 1."""
    from kvtier.bench import missing_extra

    try:
        import matplotlib
    except ModuleNotFoundError as e:
        raise (missing_extra(e, "a figure") or e) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path, dpi: int = 110) -> None:
    """Write a figure (its folder made first) and free it."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
