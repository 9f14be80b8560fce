"""The run's figures drawn from a history of step summaries: pure functions of their input.

``draw_partition(history, partition, folder, dpi)`` draws and writes (atomically) every PNG of a
partition (``train``: ``TRAIN_FIGURES``, plus ``staleness`` when the history has it; ``val``:
``VAL_FIGURES``) and returns the paths; ``callbacks/figures.py`` says what each figure shows and
when it is drawn. This module imports matplotlib and nothing heavier, so that the process that
draws in the background (``callbacks/drawing.py``) starts in well under a second. Drawing uses
matplotlib's Agg canvas directly (no pyplot state).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from atlas_lightning.store.files import atomic_write

TRAIN_FIGURES = ("reward", "explores", "cost_vs_accuracy", "terminal_reasons")
VAL_FIGURES = TRAIN_FIGURES + ("accuracy_views",)
_BENCH_MARKERS = ("o", "s", "^", "D", "v")


def _new_figure(width: float = 6.4, height: float = 4.0, right: float = 0.96) -> Figure:
    # Fixed margins: a layout engine would double the drawing time of every figure.
    figure = Figure(figsize=(width, height))
    FigureCanvasAgg(figure)
    figure.subplots_adjust(left=0.11, right=right, bottom=0.13, top=0.9, wspace=0.3)
    return figure


def _step_axis(ax) -> None:
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _steps(history: Sequence[Mapping]) -> list[int]:
    return [h["step"] for h in history]


def draw_reward(history: Sequence[Mapping], title: str) -> Figure:
    figure = _new_figure()
    ax = figure.add_subplot()
    steps = _steps(history)
    for key, label in (("score", "training reward"), ("objective", "objective (acc - cost)"), ("acc", "accuracy")):
        ax.plot(steps, [h["mean"][key] for h in history], marker="o", markersize=3, label=label)
    _step_axis(ax)
    ax.set_ylabel("mean per trajectory")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return figure


def draw_explores(history: Sequence[Mapping], title: str) -> Figure:
    figure = _new_figure(9.0, 3.6)
    figure.subplots_adjust(top=0.85)
    left, right = figure.subplots(1, 2)
    left.plot(_steps(history), [h["mean"]["explores"] for h in history], marker="o", markersize=3)
    _step_axis(left)
    left.set_ylabel("explores per episode (mean)")
    left.grid(alpha=0.3)
    latest = history[-1]
    counts = latest["explores_histogram"]
    right.bar([int(k) for k in counts], list(counts.values()), color="tab:orange")
    right.set_xlabel("explores in the episode")
    right.xaxis.set_major_locator(MaxNLocator(integer=True))
    right.set_ylabel("episodes")
    right.set_title(f"step {latest['step']}", fontsize="small")
    figure.suptitle(title)
    return figure


def draw_cost_vs_accuracy(history: Sequence[Mapping], title: str) -> Figure:
    figure = _new_figure()
    ax = figure.add_subplot()
    benches = sorted({b for h in history for b in h["benchmarks"]})
    scatter = None
    for i, bench in enumerate(benches):
        points = [(h["step"], h["benchmarks"][bench]) for h in history if bench in h["benchmarks"]]
        scatter = ax.scatter([p["cost_usd"] for _, p in points], [p["acc"] for _, p in points],
                             c=[s for s, _ in points], cmap="viridis", marker=_BENCH_MARKERS[i % len(_BENCH_MARKERS)],
                             vmin=min(_steps(history)), vmax=max(_steps(history)), label=bench)
    if scatter is not None:
        figure.colorbar(scatter, ax=ax, label="step")
        ax.legend(fontsize="small")
    ax.set_xlabel("mean cost per trajectory (USD)")
    ax.set_ylabel("accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return figure


def draw_terminal_reasons(history: Sequence[Mapping], title: str) -> Figure:
    figure = _new_figure(8.0, 4.0, right=0.76)
    ax = figure.add_subplot()
    steps = _steps(history)
    reasons = list(dict.fromkeys(r for h in history for r in h["terminal_reasons"]))
    bottom = [0] * len(steps)
    for reason in reasons:
        counts = [h["terminal_reasons"].get(reason, 0) for h in history]
        if any(counts):
            ax.bar(steps, counts, bottom=bottom, label=reason, width=0.8)
            bottom = [b + c for b, c in zip(bottom, counts)]
    _step_axis(ax)
    ax.set_ylabel("trajectories")
    ax.set_title(title)
    if any(bottom):
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return figure


def draw_accuracy_views(history: Sequence[Mapping], title: str) -> Figure:
    figure = _new_figure(8.0, 4.0, right=0.72)
    ax = figure.add_subplot()
    keys = sorted({k for h in history for k in h.get("views", {}) if k.endswith("/acc")})
    for key in keys:
        points = [(h["step"], h["views"][key]) for h in history if key in h.get("views", {})]
        ax.plot([s for s, _ in points], [v for _, v in points], marker="o", markersize=3, label=key[: -len("/acc")])
    _step_axis(ax)
    ax.set_ylabel("accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if keys:
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return figure


def draw_staleness(history: Sequence[Mapping], title: str) -> Figure:
    figure = _new_figure(9.0, 3.6)
    figure.subplots_adjust(top=0.85)
    left, right = figure.subplots(1, 2)
    points = [h for h in history if "staleness" in h]
    steps = [h["step"] for h in points]
    lags = sorted({int(k) for h in points for k in h["staleness"]["trajectories"]})
    bottom = [0.0] * len(points)
    for lag in lags:
        counts = [h["staleness"]["trajectories"].get(str(lag), 0.0) for h in points]
        left.bar(steps, counts, bottom=bottom, width=0.8, label=f"{lag} behind")
        bottom = [b + c for b, c in zip(bottom, counts)]
    left.bar(steps, [h["staleness"]["dropped"] for h in points], bottom=bottom, width=0.8, color="tab:red",
             label="dropped")
    _step_axis(left)
    left.set_ylabel("trajectories")
    left.legend(fontsize="small")
    for key, label in (("trainer_idle_share", "trainer idle"), ("engine_idle_share", "engine idle")):
        right.plot(steps, [h["staleness"][key] for h in points], marker="o", markersize=3, label=label)
    _step_axis(right)
    right.set_ylim(0.0, 1.0)
    right.set_ylabel("share of the step")
    right.grid(alpha=0.3)
    right.legend(fontsize="small")
    figure.suptitle(title)
    return figure


_DRAW = {
    "reward": draw_reward, "explores": draw_explores, "cost_vs_accuracy": draw_cost_vs_accuracy,
    "terminal_reasons": draw_terminal_reasons, "accuracy_views": draw_accuracy_views, "staleness": draw_staleness,
}


def save_figure(figure: Figure, path: Path, dpi: int) -> Path:
    """PNG written atomically."""
    return atomic_write(path, lambda handle: figure.savefig(handle, format="png", dpi=dpi), binary=True)


def figure_names(partition: str, history: Sequence[Mapping]) -> tuple[str, ...]:
    """The figures of ``partition`` drawn from ``history``."""
    names = TRAIN_FIGURES if partition == "train" else VAL_FIGURES
    if any("staleness" in h for h in history):
        names = names + ("staleness",)
    return names


def draw_partition(history: Sequence[Mapping], partition: str, folder: Path, dpi: int) -> list[Path]:
    """Draw and write every figure of ``partition`` (``train`` or ``val``) from ``history`` (each
    entry a step with trajectories) into ``folder``; returns the paths, in ``figure_names`` order."""
    label = "train" if partition == "train" else "validation"
    return [save_figure(_DRAW[name](history, f"{label}: {name.replace('_', ' ')}"), Path(folder) / f"{name}.png", dpi)
            for name in figure_names(partition, history)]
