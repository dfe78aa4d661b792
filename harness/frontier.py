"""Pareto frontiers of benchmark rows (e.g. output tok/s/GPU vs tok/s/user, or tok/s/GPU vs median E2EL).

Each axis has an explicit direction instead of a quadrant name: `x_better="lower"` for a latency x-axis,
`"higher"` for interactivity; `y_better` defaults to `"higher"` (throughput). A row is on the frontier
when no other row is at least as good on both axes and strictly better on one.

Same algorithm as InferenceX and vLLM `plot_pareto`: sort best-x first, one pass keeping rows whose y
beats the best y seen so far. Deterministic on ties: among rows with equal x the best y wins; exact
duplicates (same x and y) keep only the first in input order. Rows whose x or y is None or NaN are
skipped (e.g. an interactivity with no TPOT samples). The result is sorted by x ascending.
"""

from __future__ import annotations

import math
from typing import Any, Hashable, Iterable, Literal, Mapping, Sequence

Better = Literal["lower", "higher"]

DEFAULT_GROUP_KEYS = ("hardware", "engine", "spec_mode", "is_projected")


def pareto_frontier(
    rows: Iterable[Mapping[str, Any]],
    x: str,
    y: str,
    x_better: Better = "lower",
    y_better: Better = "higher",
) -> list[Mapping[str, Any]]:
    """The non-dominated rows (the row objects themselves), sorted by x ascending."""
    x_sign = _sign(x_better, "x_better")
    y_sign = _sign(y_better, "y_better")
    scored = []
    for index, row in enumerate(rows):
        xv = _value(row, x, index)
        yv = _value(row, y, index)
        if xv is None or yv is None:
            continue
        # In (gx, gy) space both axes are "higher is better".
        scored.append((x_sign * xv, y_sign * yv, index, row))
    # Best x first; for equal x best y first; then input order (so the first duplicate is kept).
    scored.sort(key=lambda s: (-s[0], -s[1], s[2]))
    frontier = []
    best_gy = -math.inf
    for _gx, gy, _index, row in scored:
        if gy > best_gy:
            frontier.append(row)
            best_gy = gy
    frontier.sort(key=lambda row: float(row[x]))
    return frontier


def frontiers(
    rows: Iterable[Mapping[str, Any]],
    group_keys: Sequence[str],
    x: str,
    y: str,
    x_better: Better = "lower",
    y_better: Better = "higher",
) -> dict[tuple[Hashable, ...], list[Mapping[str, Any]]]:
    """One frontier per group, keyed by the tuple of the rows' `group_keys` values (a missing key reads
    as None). Groups appear in order of first appearance; groups whose rows all lack x or y map to []."""
    groups: dict[tuple[Hashable, ...], list[Mapping[str, Any]]] = {}
    for row in rows:
        key = tuple(row.get(k) for k in group_keys)
        groups.setdefault(key, []).append(row)
    return {key: pareto_frontier(members, x, y, x_better, y_better) for key, members in groups.items()}


def _sign(better: str, name: str) -> float:
    if better == "higher":
        return 1.0
    if better == "lower":
        return -1.0
    raise ValueError(f"{name} must be 'lower' or 'higher', got {better!r}")


def _value(row: Mapping[str, Any], key: str, index: int) -> float | None:
    if key not in row:
        raise ValueError(f"row {index} has no {key!r} field (fields: {sorted(row)})")
    value = row[key]
    if value is None:
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"row {index}: {key}={row[key]!r} is not a number") from None
    if math.isnan(value):
        return None
    return value
