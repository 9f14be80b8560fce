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

Where (``background``): in the step itself, or, with ``background`` on (``auto``: when the trainer
trains on a GPU, whose host has cores to spare; on a CPU the drawing would take the cores the
training uses), in one process of its own (``callbacks/drawing.py``). Then a step's training
figures are submitted at its end and waited for at the start of the next step's update
(``on_train_batch_start``, after its rollout: the drawing overlaps the generation), before any
validation figures, at train end, and after an exception; their W&B images are logged then, at
their own step and before anything of a later step (W&B drops a row logged below a step it has).
``terminal_reasons.json`` is always written in the step.

Each figure is also logged to W&B with ``atlas_lightning.loggers.wandb_logger.log_image(trainer, key, path,
step)`` (key ``train_figures/<stem>`` or ``val_figures/<stem>``) when the trainer has a W&B logger. An
upload that fails is a warning (the W&B service must never end a run); drawing or writing that
fails is an error, raised on every rank (it is a bug here, found by the tests, not weather).

Collective: ``on_train_batch_end`` gathers each rank's per-trajectory rows (a few numbers each)
on rank 0; only rank 0 keeps history and draws. The history is in ``state_dict`` so a resumed
run continues its curves. The figures themselves are ``callbacks/plots.py``'s.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import lightning as L

from atlas_lightning import distributed
from atlas_lightning.env.terminal import TERMINAL_REASON_CODES
from atlas_lightning.store.records import FILE_VERSION, utc_now
from atlas_lightning.distributed import on_rank_zero
from atlas_lightning.store.files import atomic_write_json
from atlas_lightning.callbacks.base import RLCallback
from atlas_lightning.callbacks.drawing import BackgroundDrawing
from atlas_lightning.callbacks.plots import draw_partition
from atlas_lightning.loggers.wandb_logger import log_image
from atlas_lightning.ppo.step_output import read_step_output
from atlas_lightning.reward.summary import step_summary, trajectory_row

log = logging.getLogger(__name__)

TERMINAL_JSON = "terminal_reasons.json"


# ----------------------------------------------------------------------------- summaries


def staleness_summary(metrics: Mapping[str, float]) -> Optional[dict]:
    """What the staleness figure keeps of a step's metrics (None in synchronous layouts)."""
    prefix = "rollout/staleness_hist/"
    if not any(k.startswith(prefix) for k in metrics):
        return None
    return {"trajectories": {k[len(prefix):]: float(v) for k, v in metrics.items() if k.startswith(prefix)},
            "dropped": float(metrics.get("rollout/dropped_trajectories", 0.0)),
            "trainer_idle_share": float(metrics.get("perf/trainer_idle_share", 0.0)),
            "engine_idle_share": float(metrics.get("perf/engine_idle_share", 0.0))}


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
    (the run's ``paths.artifacts``); ``dpi`` of the PNGs; ``background``: True, False or
    ``"auto"`` (the training figures drawn in a process of their own; ``auto``: on a GPU). See
    the module docstring."""

    def __init__(self, artifacts: str | Path, every_n_steps: int = 1, dpi: int = 80,
                 total_steps: Optional[int] = None, background: bool | str = False) -> None:
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
            raise ValueError(f"FiguresCallback: every_n_steps must be an int >= 1, got {every_n_steps!r}")
        if not isinstance(dpi, int) or isinstance(dpi, bool) or dpi < 10:
            raise ValueError(f"FiguresCallback: dpi must be an int >= 10, got {dpi!r}")
        if not (isinstance(background, bool) or background == "auto"):
            raise ValueError(f"FiguresCallback: background must be true, false or auto, got {background!r}")
        self.artifacts = Path(artifacts)
        self.every_n_steps = every_n_steps
        self.dpi = dpi
        self.total_steps = total_steps
        self.background = background
        #: ``{"train": [step summary], "val": [step summary + "views"]}`` (``_summary.step_summary``).
        self.history: dict[str, list[dict]] = {"train": [], "val": []}
        self._drawn_step: Optional[int] = None
        self._image_warned = False
        self._in_background = False  # ``background`` resolved by ``setup``, the same on every rank
        self._drawing: Optional[BackgroundDrawing] = None  # rank 0's, when in the background
        self._awaited_step: Optional[int] = None  # every rank: the step whose figures are being drawn

    # -- hooks --------------------------------------------------------------------------

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._in_background = (trainer.strategy.root_device.type == "cuda" if self.background == "auto"
                               else self.background)
        if self._in_background and trainer.is_global_zero and self._drawing is None:
            self._drawing = BackgroundDrawing()
            self._drawing.start()  # its start-up overlaps the model's build and the engine's

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._collect(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        out = read_step_output(outputs, "FiguresCallback.on_train_batch_end")
        if not out.finite:
            return
        gathered = distributed.gather_objects([trajectory_row(r) for r in out.records])
        due = out.step % self.every_n_steps == 0 or out.step == self.total_steps

        def record_and_draw() -> None:
            summary = step_summary(out.step, [row for rank_rows in gathered for row in rank_rows])
            staleness = staleness_summary(out.metrics)
            if staleness is not None:
                summary["staleness"] = staleness
            self._add("train", summary)
            folder = self.artifacts / "train_figures"
            atomic_write_json(folder / TERMINAL_JSON, terminal_reason_history(self.history["train"], "train"))
            if due and self._drawing is not None:
                self._drawing.submit(out.step, self._drawable("train"), "train", folder, self.dpi)
            elif due:
                self.draw(trainer, "train", folder, out.step)

        on_rank_zero(record_and_draw, f"the figures of step {out.step}")
        if due and self._in_background:
            self._awaited_step = out.step

    def on_rl_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int,
                             metrics: Mapping[str, float], rows: Optional[list]) -> None:
        """Called by ``ValidationCallback`` on every rank (collective); ``rows`` only on rank 0."""
        self._collect(trainer)

        def record_and_draw() -> None:
            summary = step_summary(step, rows or [])
            summary["views"] = {k: float(v) for k, v in metrics.items() if k.count("/") == 2
                                and not k.startswith(("val/", "timing_s/"))}
            self._add("val", summary)
            self.draw(trainer, "val", self.artifacts / "val_figures", step)

        on_rank_zero(record_and_draw, f"the validation figures of step {step}")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._collect(trainer)

        def draw_latest() -> None:
            train = self.history["train"]
            if train and self._drawn_step != train[-1]["step"]:
                self.draw(trainer, "train", self.artifacts / "train_figures", train[-1]["step"])

        on_rank_zero(draw_latest, "the closing training figures")

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # not collective (the run is ending): rank 0 lets the pending figures reach the disk
        self._awaited_step = None
        if self._drawing is not None:
            try:
                self._drawing.wait()
            except Exception as err:
                log.warning("FiguresCallback: the figures being drawn when the run failed were not written (%s: %s)",
                            type(err).__name__, err)
            self._drawing.close()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._drawing is not None:
            self._drawing.close()

    # -- work ---------------------------------------------------------------------------

    def _collect(self, trainer: L.Trainer) -> None:
        """Wait for the figures being drawn in the background, then log their images (collective
        while any are awaited: a drawing's failure fails every rank)."""
        if self._awaited_step is None:
            return
        step, self._awaited_step = self._awaited_step, None

        def wait_and_log() -> None:
            done = self._drawing.wait() if self._drawing is not None else None
            if done is not None:
                self._drawn_step = done[0]
                self._log_images(trainer, "train_figures", done[1], done[0])

        on_rank_zero(wait_and_log, f"the figures of step {step}")

    def _add(self, partition: str, summary: dict) -> None:
        # A step seen again (a run resumed from an earlier checkpoint) replaces what followed it.
        kept = [h for h in self.history[partition] if h["step"] < summary["step"]]
        self.history[partition] = kept + [summary]

    def _drawable(self, partition: str) -> list[dict]:
        return [h for h in self.history[partition] if h.get("trajectories")]

    def draw(self, trainer: Optional[L.Trainer], partition: str, folder: Path, step: int) -> list[Path]:
        """Draw and write every figure of ``partition`` from the history in this process (rank 0);
        returns the paths."""
        history = self._drawable(partition)
        if not history:
            return []
        if partition == "val":
            atomic_write_json(folder / TERMINAL_JSON, terminal_reason_history(history, "val"))
        paths = draw_partition(history, partition, folder, self.dpi)
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
