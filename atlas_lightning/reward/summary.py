"""Per-trajectory rows and their aggregates: the validation metrics (README, "Validation") and the
figures' per-step history.

A row is the few numbers of a record that the metrics and figures need (small enough to gather
from every rank every step):

=================  ======================================================================
key                value
=================  ======================================================================
benchmark          ``gpqa`` / ``lcb``
subsets            ``{column: value}`` (``record.extra["subsets"]``), may be empty
acc                1/0, the submit graded correct
objective          acc - cost (reward points)
cost               lambda x cost_total (reward points; ``reward.cost``)
cost_usd           dollars spent on revealed candidates (``reward.cost_total``)
explores           charged explores (revealed candidates, ``reward.num_explores``)
score              the training reward (``reward_score``)
terminal_reason    the episode's terminal reason name (``atlas_lightning.env.terminal``)
=================  ======================================================================

Views (``view_metrics``): for every benchmark present, ``<bench>/overall/<field>`` and
``<bench>/<subset value>/<field>`` for every subset value its rows carry, with ``field`` in
``acc``, ``objective``, ``cost``, ``cost_usd``, ``explores``; each the mean over the view's rows.
A subset value that names two columns' values, or is ``overall``, is written
``<column>=<value>``; a ``/`` inside a value becomes ``_`` (it would split the metric name).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Any, Iterable, Mapping, Sequence

from atlas_lightning.env.terminal import TERMINAL_REASON_CODES, TERMINAL_REASONS

VIEW_FIELDS = ("acc", "objective", "cost", "cost_usd", "explores")
_REASON_BY_CODE = {code: name for name, code in TERMINAL_REASON_CODES.items()}


def trajectory_row(record: Any) -> dict:
    """The row of one ``TrajectoryRecord`` (see the module table)."""
    reward = record.reward
    where = f"trajectory {record.uid}/{record.session_id}"
    try:
        acc, objective, cost = float(reward["acc"]), float(reward["objective"]), float(reward["cost"])
        cost_usd, explores = float(reward["cost_total"]), int(reward["num_explores"])
    except KeyError as err:
        raise ValueError(f"{where}: its reward breakdown lacks {err.args[0]!r}") from None
    reason = (record.episode or {}).get("terminal_reason")
    if reason is None:
        reason = _REASON_BY_CODE.get(reward.get("terminal_reason_code"), "unknown")
    subsets = (record.extra or {}).get("subsets") or {}
    return {
        "benchmark": record.benchmark, "subsets": {str(k): str(v) for k, v in subsets.items()},
        "acc": acc, "objective": objective, "cost": cost, "cost_usd": cost_usd, "explores": explores,
        "score": float(record.reward_score), "terminal_reason": str(reason),
    }


def _mean(rows: Sequence[Mapping[str, Any]], key: str) -> float:
    return math.fsum(float(r[key]) for r in rows) / len(rows)


def _view_names(rows: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], str]:
    """``(column, value) -> view name`` for one benchmark's rows."""
    columns_of_value: dict[str, set[str]] = defaultdict(set)
    for row in rows:
        for column, value in row["subsets"].items():
            if value != "":
                columns_of_value[value].add(column)
    names = {}
    for value, columns in columns_of_value.items():
        for column in columns:
            name = value if len(columns) == 1 and value != "overall" else f"{column}={value}"
            names[(column, value)] = name.replace("/", "_")
    return names


def view_metrics(rows: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """``{"<bench>/<view>/<field>": mean}`` over the views of the module docstring."""
    by_bench: dict[str, list] = defaultdict(list)
    for row in rows:
        by_bench[row["benchmark"]].append(row)
    metrics: dict[str, float] = {}
    for bench in sorted(by_bench):
        bench_rows = by_bench[bench]
        names = _view_names(bench_rows)
        views: dict[str, list] = {"overall": bench_rows}
        for row in bench_rows:
            for column, value in row["subsets"].items():
                if (column, value) in names:
                    views.setdefault(names[(column, value)], []).append(row)
        for view, view_rows in views.items():
            for field in VIEW_FIELDS:
                metrics[f"{bench}/{view}/{field}"] = _mean(view_rows, field)
    return metrics


def terminal_counts(rows: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """``{reason: count}`` over every known reason (zeros included, code order), then any other."""
    counts = Counter(row["terminal_reason"] for row in rows)
    out = {reason: int(counts.pop(reason, 0)) for reason in TERMINAL_REASONS}
    out.update({reason: int(n) for reason, n in sorted(counts.items())})
    return out


def step_summary(step: int, rows: Sequence[Mapping[str, Any]]) -> dict:
    """What the figures keep of one step (JSON-ready): means over all rows and per benchmark,
    the explores-per-episode histogram and the terminal-reason counts."""
    rows = list(rows)
    summary: dict[str, Any] = {"step": int(step), "trajectories": len(rows)}
    if not rows:
        return summary
    summary["mean"] = {key: _mean(rows, key) for key in ("score", *VIEW_FIELDS)}
    by_bench: dict[str, list] = defaultdict(list)
    for row in rows:
        by_bench[row["benchmark"]].append(row)
    summary["benchmarks"] = {
        bench: {"trajectories": len(b_rows), **{key: _mean(b_rows, key) for key in ("score", *VIEW_FIELDS)}}
        for bench, b_rows in sorted(by_bench.items())
    }
    histogram = Counter(int(row["explores"]) for row in rows)
    summary["explores_histogram"] = {str(k): histogram[k] for k in range(max(histogram) + 1)}
    summary["terminal_reasons"] = terminal_counts(rows)
    return summary
