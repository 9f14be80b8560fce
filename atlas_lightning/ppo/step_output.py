"""Reading the step output that ``PPOModule.training_step`` returns (``interfaces.md``).

Lightning hands it to every callback's ``on_train_batch_end`` as ``outputs`` (a shallow copy of
the returned dict under manual optimization). ``read_step_output`` checks the contract once and
gives a typed view, so that a module returning something else fails with the missing or broken
key named instead of a ``KeyError`` deep inside a callback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

REQUIRED_KEYS = ("step", "batch", "tensors", "metrics", "finite")


@dataclass(frozen=True)
class StepOutput:
    """One RL step's output. ``tensors``: name -> one 1-D float32 array per trajectory of
    ``batch.records`` (this rank's); ``nonfinite``: the module's diagnostic when ``finite`` is False
    (``{"what": [names], "where": {name: {"count", "trajectories"}}, "phase": str}``)."""

    step: int
    batch: Any  # atlas_lightning.rollout.batch.RolloutBatch
    tensors: Mapping[str, list]
    metrics: Mapping[str, float]
    finite: bool
    nonfinite: Optional[Mapping[str, Any]] = None

    @property
    def records(self) -> list:
        return list(self.batch.records)


def read_step_output(outputs: Any, hook: str = "on_train_batch_end") -> StepOutput:
    """The typed step output; ``ValueError`` naming the hook and the broken key otherwise."""
    where = f"{hook}: the training_step output"
    if not isinstance(outputs, Mapping):
        raise ValueError(f"{where} must be the step-output dict of interfaces.md, got {type(outputs).__name__}")
    missing = [key for key in REQUIRED_KEYS if key not in outputs]
    if missing:
        raise ValueError(f"{where} lacks key(s) {', '.join(missing)} (has: {', '.join(sorted(map(str, outputs)))})")
    step = outputs["step"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"{where}: 'step' must be the 1-based RL step (an int >= 1), got {step!r}")
    finite = outputs["finite"]
    if not isinstance(finite, bool):
        raise ValueError(f"{where}: 'finite' must be a bool, got {finite!r}")
    batch = outputs["batch"]
    if not hasattr(batch, "records"):
        raise ValueError(f"{where}: 'batch' must be a RolloutBatch (with .records), got {type(batch).__name__}")
    if getattr(batch, "step", step) != step:
        raise ValueError(f"{where}: 'step' is {step} but its batch is of step {batch.step}")
    tensors = outputs["tensors"]
    if not isinstance(tensors, Mapping):
        raise ValueError(f"{where}: 'tensors' must be a dict name -> list of arrays, got {type(tensors).__name__}")
    metrics = outputs["metrics"]
    if not isinstance(metrics, Mapping):
        raise ValueError(f"{where}: 'metrics' must be a dict of floats, got {type(metrics).__name__}")
    nonfinite = outputs.get("nonfinite")
    if not finite and not isinstance(nonfinite, Mapping):
        raise ValueError(f"{where}: 'finite' is False but 'nonfinite' is {nonfinite!r}, not the diagnostic dict")
    return StepOutput(step=step, batch=batch, tensors=tensors, metrics=metrics, finite=finite, nonfinite=nonfinite)


def run_config(pl_module: Any, hook: str) -> Any:
    """``pl_module.cfg`` (the run's config), or a ``ValueError`` naming the hook."""
    cfg = getattr(pl_module, "cfg", None)
    if cfg is None:
        raise ValueError(f"{hook}: the LightningModule has no .cfg (the run's config); these callbacks need it")
    return cfg
