"""Benchmark goals as data: one `Goal` record and one evaluator for every benchmark.

A goal selects the items it judges from a run's rows (cells, rows, or one aggregate figure), checks
each, and reports its numbers. Goals are judged from the rows only, so re-rendering a saved JSON
re-judges it. The JSON entry of a goal is {"goal": name, "met": ..., **fields(items)}.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

Item = dict[str, Any]


class Empty(enum.Enum):
    """What a goal with nothing to judge means (a run that did not measure its cells)."""

    OMIT = "omit"  # leave the goal out of the report
    UNMET = "unmet"  # report it NOT met ("not measured" counts against it)
    UNJUDGED = "unjudged"  # report met = None (neither met nor failed)


def _no_fields(items: list[Item]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Goal:
    name: str  # what the reader sees, the JSON's "goal"
    select: Callable[[Sequence[Item]], list[Item]]  # rows -> the items judged
    # One item within the goal? None: not judged (e.g. a cell missing a peer); listed, not counted.
    check: Callable[[Item], bool | None]
    fields: Callable[[list[Item]], dict[str, Any]] = _no_fields  # the rest of the JSON entry: summary, numbers
    empty: Empty = Empty.OMIT


def judge(goal: Goal, rows: Sequence[Item]) -> dict[str, Any] | None:
    """The JSON entry of one goal (None where an empty goal is omitted)."""
    items = goal.select(rows)
    verdicts = [v for v in (goal.check(i) for i in items) if v is not None]
    met: bool | None
    if verdicts:
        met = all(verdicts)
    elif goal.empty is Empty.OMIT:
        return None
    else:
        met = False if goal.empty is Empty.UNMET else None
    return {"goal": goal.name, "met": met, **goal.fields(items)}


def evaluate(goals: Iterable[Goal], rows: Sequence[Item]) -> list[dict[str, Any]]:
    """Every goal's JSON entry, in the order given (the one evaluator of every benchmark)."""
    return [entry for g in goals if (entry := judge(g, rows)) is not None]


def one(item: Item | None) -> list[Item]:
    """A selection of at most one aggregate item (a goal judged on one figure)."""
    return [] if item is None else [item]


def met_label(met: bool | None) -> str:
    return "not measured" if met is None else ("met" if met else "NOT met")


def verdict(item: Item) -> bool | None:
    """The check of a goal whose items carry their own verdict under "met"."""
    return item["met"]


def figure_fields(items: list[Item]) -> dict[str, Any]:
    """The entry of a goal judged on one figure: that item's fields (its verdict is the entry's "met")."""
    return {k: v for k, v in items[0].items() if k != "met"}


def figure(name: str, select: Callable[[Sequence[Item]], list[Item]], empty: Empty = Empty.OMIT) -> Goal:
    """A goal on one figure (value, target, summary ...) that `select` judges as it computes it."""
    return Goal(name, select, verdict, figure_fields, empty)
