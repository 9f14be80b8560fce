"""``RLProgressBar``: progress a person can read, in RL steps.

The bar (Lightning's tqdm bar, counting RL steps, with its rate and ETA) shows the phase (the
rollout's trajectories done out of the total and its tokens a second, then ``update``), the
last step's reward, objective and time, and the last validation objective. After every step it
writes one line, as verl prints one, to the console above the bar and to the run's logs
(``outputs/<name>/main_ppo.log``, ``logs/``)::

    step 3/40 | reward 0.412 | acc 0.531 | objective 0.498 | explores 2.10 | 107.2 s (gen 10.8, update 53.9) | val objective 0.520 (step 0)

Rank 0 only; the numbers come from the step's output (``ppo/step_output.py``) and the
validation hook (``base.RLCallback.on_rl_validation_end``), so the bar logs nothing itself.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from lightning.pytorch.callbacks import TQDMProgressBar

from atlas_lightning.callbacks.base import RLCallback
from atlas_lightning.ppo.step_output import read_step_output

log = logging.getLogger("atlas_lightning.progress")

#: (label, metric) pairs of the step line, in order; a metric the step lacks is left out.
STEP_FIELDS = (("reward", "critic/score/mean"), ("acc", "reward/acc"), ("objective", "reward/objective"),
               ("explores", "reward/num_explores"))
#: Validation metrics whose mean is "the validation objective" (each benchmark's overall view).
VAL_OBJECTIVE_SUFFIX = "/overall/objective"


class RLProgressBar(TQDMProgressBar, RLCallback):
    """Lightning's progress bar over RL steps (module doc). ``total_steps``: the run's
    ``trainer.total_steps`` (the bar's own total counts only what is left after a resume)."""

    def __init__(self, total_steps: Optional[int] = None, refresh_rate: int = 1) -> None:
        super().__init__(refresh_rate=refresh_rate)
        self.total_steps = total_steps
        self.phase = "starting"
        self.last: dict[str, float] = {}
        self.validation: Optional[tuple[int, float]] = None

    # -- what the bar shows ------------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        datamodule = getattr(trainer, "datamodule", None)
        if datamodule is not None and hasattr(datamodule, "progress_sink") and trainer.is_global_zero:
            datamodule.progress_sink = self.rollout_progress

    def on_train_epoch_start(self, trainer: Any, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        if self.train_progress_bar is not None:
            self.train_progress_bar.set_description("RL steps")

    def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
        shown: dict[str, Any] = {"phase": self.phase}
        for label, key in STEP_FIELDS[:2]:
            if key in self.last:
                shown[label] = f"{self.last[key]:.3f}"
        if "timing_s/step" in self.last:
            shown["step_s"] = f"{self.last['timing_s/step']:.1f}"
        if self.validation is not None:
            shown["val_obj"] = f"{self.validation[1]:.3f}"
        return shown

    def rollout_progress(self, label: str, done: int, total: int, tokens_per_second: float) -> None:
        """The datamodule's rollout progress (``RolloutDataModule.progress_sink``)."""
        self.phase = f"{label.split(' ')[0]} {done}/{total} ({tokens_per_second:,.0f} tok/s)"
        self._refresh()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.phase = "update"
        self._refresh()

    # -- after a step ------------------------------------------------------------------------

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        out = read_step_output(outputs, "RLProgressBar.on_train_batch_end")
        self.last = dict(out.metrics)
        self.phase = "rollout"
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if trainer.is_global_zero:
            self._write(step_line(out.step, self.total_steps, self.last, self.validation, out.finite))

    def on_rl_validation_end(self, trainer: Any, pl_module: Any, step: int, metrics: dict, rows: Any) -> None:
        objective = validation_objective(metrics)
        if objective is not None:
            self.validation = (step, objective)
            if trainer.is_global_zero:
                self._write(f"validation step {step} | objective {objective:.3f} | "
                            + " | ".join(f"{k.split('/')[0]} acc {v:.3f}" for k, v in sorted(metrics.items())
                                         if k.endswith("/overall/acc")))

    def _write(self, line: str) -> None:
        """One line above the bar (or on stderr without one) and in the run's logs."""
        log.info(line)
        bar = self._train_progress_bar
        if bar is not None and not bar.disable:
            bar.write(line)
        else:
            import sys

            print(line, file=sys.stderr, flush=True)

    def _refresh(self) -> None:
        bar = self._train_progress_bar
        if bar is not None and not bar.disable:
            bar.set_postfix(self.get_metrics(None, None), refresh=True)


def validation_objective(metrics: dict) -> Optional[float]:
    """The mean of every benchmark's overall validation objective (``gpqa/overall/objective``, ...)."""
    values = [float(v) for k, v in metrics.items() if k.endswith(VAL_OBJECTIVE_SUFFIX) and k.count("/") == 2]
    return sum(values) / len(values) if values else None


def step_line(step: int, total: Optional[int], metrics: dict, validation: Optional[tuple[int, float]],
              finite: bool = True) -> str:
    """The per-step line of the module doc, from a step's metrics."""
    parts = [f"step {step}/{total}" if total else f"step {step}"]
    parts += [f"{label} {metrics[key]:.3f}" for label, key in STEP_FIELDS if key in metrics]
    if "timing_s/step" in metrics:
        phases = [f"{name} {metrics[f'timing_s/{key}']:.1f}" for name, key in
                  (("gen", "gen"), ("update", "update_actor"), ("critic", "update_critic")) if f"timing_s/{key}" in metrics]
        parts.append(f"{metrics['timing_s/step']:.1f} s" + (f" ({', '.join(phases)})" if phases else ""))
    if validation is not None:
        parts.append(f"val objective {validation[1]:.3f} (step {validation[0]})")
    if not finite:
        parts.append("NON-FINITE: update skipped (see the NaN guard)")
    return " | ".join(parts)
