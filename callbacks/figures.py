"""``FiguresCallback``: training and validation curves as PNGs, and the terminal-reason history.

Files (README, "On-disk layout"), each rewritten atomically with the whole history so far:

- ``artifacts/<name>/train_figures/``: ``reward.png`` (mean training reward, objective and
  accuracy over steps), ``explores.png`` (mean explores per episode over steps; the latest
  step's histogram of explores per episode), ``cost_vs_accuracy.png`` (each step's mean dollar
  cost against accuracy, per benchmark, coloured by step), ``terminal_reasons.png`` (terminal
  reasons stacked over steps) and ``terminal_reasons.json`` (per step, the count of each
  terminal reason; rewritten every finite step);
- ``artifacts/<name>/val_figures/``: the same four figures over validation steps, plus
  ``accuracy_views.png`` (``<bench>/<view>/acc`` over validation steps);
- in the separate layout only, ``train_figures/staleness.png``: each step's trajectories by how
  many versions they lag (stacked, dropped ones on top) and the trainer's and engine's idle
  shares (``ppo/metrics.asynchronous_metrics``).

When: the training figures every ``every_n_steps`` finite steps and at the last step (and at
train end if the last drawn step is not the latest); the validation figures after every
validation (``on_rl_validation_end``, called by ``ValidationCallback``). Non-finite steps are
left out (no update happened; the NaN guard owns them).

Each figure is also logged to W&B with ``atlas_lightning.loggers.wandb_logger.log_image(trainer, key, path,
step)`` (key ``train_figures/<stem>`` or ``val_figures/<stem>``) when the trainer has a W&B logger. An
upload that fails is a warning (the W&B service must never end a run); drawing or writing that
fails is an error, raised on every rank (it is a bug here, found by the tests, not weather).

Collective: ``on_train_batch_end`` gathers each rank's per-trajectory rows (a few numbers each)
on rank 0; only rank 0 keeps history and draws. The history is in ``state_dict`` so a resumed
run continues its curves. Drawing uses matplotlib's Agg canvas directly (no pyplot state).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import lightning as L
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from atlas_lightning import distributed
from atlas_lightning.env.terminal import TERMINAL_REASON_CODES
from atlas_lightning.store.records import FILE_VERSION, utc_now
from atlas_lightning.distributed import on_rank_zero
from atlas_lightning.store.files import atomic_write, atomic_write_json
from atlas_lightning.callbacks.base import RLCallback
from atlas_lightning.loggers.wandb_logger import log_image
from atlas_lightning.ppo.step_output import read_step_output
from atlas_lightning.reward.summary import step_summary, trajectory_row

log = logging.getLogger(__name__)

TRAIN_FIGURES = ("reward", "explores", "cost_vs_accuracy", "terminal_reasons")
VAL_FIGURES = TRAIN_FIGURES + ("accuracy_views",)
TERMINAL_JSON = "terminal_reasons.json"
_BENCH_MARKERS = ("o", "s", "^", "D", "v")


# ----------------------------------------------------------------------------- drawing


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


def staleness_summary(metrics: Mapping[str, float]) -> Optional[dict]:
    """What the staleness figure keeps of a step's metrics (None in synchronous layouts)."""
    prefix = "rollout/staleness_hist/"
    if not any(k.startswith(prefix) for k in metrics):
        return None
    return {"trajectories": {k[len(prefix):]: float(v) for k, v in metrics.items() if k.startswith(prefix)},
            "dropped": float(metrics.get("rollout/dropped_trajectories", 0.0)),
            "trainer_idle_share": float(metrics.get("perf/trainer_idle_share", 0.0)),
            "engine_idle_share": float(metrics.get("perf/engine_idle_share", 0.0))}


_DRAW = {
    "reward": draw_reward, "explores": draw_explores, "cost_vs_accuracy": draw_cost_vs_accuracy,
    "terminal_reasons": draw_terminal_reasons, "accuracy_views": draw_accuracy_views, "staleness": draw_staleness,
}


def save_figure(figure: Figure, path: Path, dpi: int) -> Path:
    """PNG written atomically."""
    return atomic_write(path, lambda handle: figure.savefig(handle, format="png", dpi=dpi), binary=True)


def terminal_reason_history(history: Sequence[Mapping], partition: str) -> dict:
    """The content of ``terminal_reasons.json``."""
    return {
        "file_version": FILE_VERSION,
        "written_at": utc_now(),
        "partition": partition,
        "codes": dict(TERMINAL_REASON_CODES),
        "steps": [{"step": h["step"], "total": h["trajectories"], "counts": dict(h["terminal_reasons"])}
                  for h in history if "terminal_reasons" in h],
    }


# ----------------------------------------------------------------------------- the callback


class FiguresCallback(RLCallback):
    """Training figures every ``every_n_steps`` finite steps and at the last, ``total_steps``
    (``trainer.total_steps``), validation figures after every validation, under ``artifacts``
    (the run's ``paths.artifacts``); ``dpi`` of the PNGs. See the module docstring."""

    def __init__(self, artifacts: str | Path, every_n_steps: int = 1, dpi: int = 80,
                 total_steps: Optional[int] = None) -> None:
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
            raise ValueError(f"FiguresCallback: every_n_steps must be an int >= 1, got {every_n_steps!r}")
        if not isinstance(dpi, int) or isinstance(dpi, bool) or dpi < 10:
            raise ValueError(f"FiguresCallback: dpi must be an int >= 10, got {dpi!r}")
        self.artifacts = Path(artifacts)
        self.every_n_steps = every_n_steps
        self.dpi = dpi
        self.total_steps = total_steps
        #: ``{"train": [step summary], "val": [step summary + "views"]}`` (``_summary.step_summary``).
        self.history: dict[str, list[dict]] = {"train": [], "val": []}
        self._drawn_step: Optional[int] = None
        self._image_warned = False

    # -- hooks --------------------------------------------------------------------------

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        out = read_step_output(outputs, "FiguresCallback.on_train_batch_end")
        if not out.finite:
            return
        gathered = distributed.gather_objects([trajectory_row(r) for r in out.records])

        def record_and_draw() -> None:
            summary = step_summary(out.step, [row for rank_rows in gathered for row in rank_rows])
            staleness = staleness_summary(out.metrics)
            if staleness is not None:
                summary["staleness"] = staleness
            self._add("train", summary)
            folder = self.artifacts / "train_figures"
            atomic_write_json(folder / TERMINAL_JSON, terminal_reason_history(self.history["train"], "train"))
            if out.step % self.every_n_steps == 0 or out.step == self.total_steps:
                self.draw(trainer, "train", folder, out.step)

        on_rank_zero(record_and_draw, f"the figures of step {out.step}")

    def on_rl_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int,
                             metrics: Mapping[str, float], rows: Optional[list]) -> None:
        """Called by ``ValidationCallback`` on every rank (collective); ``rows`` only on rank 0."""

        def record_and_draw() -> None:
            summary = step_summary(step, rows or [])
            summary["views"] = {k: float(v) for k, v in metrics.items() if k.count("/") == 2
                                and not k.startswith(("val/", "timing_s/"))}
            self._add("val", summary)
            self.draw(trainer, "val", self.artifacts / "val_figures", step)

        on_rank_zero(record_and_draw, f"the validation figures of step {step}")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        def draw_latest() -> None:
            train = self.history["train"]
            if train and self._drawn_step != train[-1]["step"]:
                self.draw(trainer, "train", self.artifacts / "train_figures", train[-1]["step"])

        on_rank_zero(draw_latest, "the closing training figures")

    # -- work ---------------------------------------------------------------------------

    def _add(self, partition: str, summary: dict) -> None:
        # A step seen again (a run resumed from an earlier checkpoint) replaces what followed it.
        kept = [h for h in self.history[partition] if h["step"] < summary["step"]]
        self.history[partition] = kept + [summary]

    def draw(self, trainer: Optional[L.Trainer], partition: str, folder: Path, step: int) -> list[Path]:
        """Draw and write every figure of ``partition`` from the history (rank 0); returns the paths."""
        history = [h for h in self.history[partition] if h.get("trajectories")]
        if not history:
            return []
        names = TRAIN_FIGURES if partition == "train" else VAL_FIGURES
        if any("staleness" in h for h in history):
            names = names + ("staleness",)
        label = "train" if partition == "train" else "validation"
        if partition == "val":
            atomic_write_json(folder / TERMINAL_JSON, terminal_reason_history(history, "val"))
        paths = []
        for name in names:
            figure = _DRAW[name](history, f"{label}: {name.replace('_', ' ')}")
            paths.append(save_figure(figure, folder / f"{name}.png", self.dpi))
        if partition == "train":
            self._drawn_step = step
        self._log_images(trainer, folder.name, paths, step)
        return paths

    def _log_images(self, trainer: Optional[L.Trainer], prefix: str, paths: list[Path], step: int) -> None:
        if trainer is None:
            return
        for path in paths:
            try:
                log_image(trainer, f"{prefix}/{path.stem}", path, step)
            except Exception as err:  # a figure upload must never end a run
                if not self._image_warned:
                    log.warning("FiguresCallback: logging %s to W&B failed (%s: %s); further failures are not reported",
                                path, type(err).__name__, err)
                    self._image_warned = True

    # -- resumable state ----------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"history": {k: [dict(h) for h in v] for k, v in self.history.items()}}

    def load_state_dict(self, state_dict: dict) -> None:
        history = state_dict.get("history", {})
        self.history = {"train": list(history.get("train", [])), "val": list(history.get("val", []))}
