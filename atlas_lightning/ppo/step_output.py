"""``StepOutput``: what ``PPOModule.training_step`` returns, and what every callback reads.

Lightning hands a training step's output to each callback's ``on_train_batch_end`` as
``outputs``. Under manual optimization Lightning accepts only a mapping (or a tensor, or None)
and passes on ``output.copy()``, so ``StepOutput`` is a read-only mapping of its own fields whose
``copy()`` is itself: the callbacks receive the very object the step built.

The fields are checked when a ``StepOutput`` is made, so a broken one fails where it is built.
``read_step_output`` is the callbacks' side: a ``StepOutput`` passes as is; a plain dict with
the same keys (a stand-in module's) is checked and converted; anything else is refused with
the hook and the broken key named, instead of a ``KeyError`` deep inside a callback.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Iterator, Optional

REQUIRED_KEYS = ("step", "batch", "tensors", "metrics", "finite")


@dataclass(frozen=True, eq=False)
class StepOutput(Mapping):
    """One RL step's output on this rank.

    ``step``: the 1-based RL step (``batch.step``); ``batch``: this rank's ``RolloutBatch``;
    ``tensors``: name -> one 1-D float32 array per trajectory of ``batch.records`` (``values``,
    ``returns``, ``advantages``, ``old_log_probs``, ``token_rewards``, ``ref_log_probs`` when a
    KL is on), each as long as that trajectory's response; ``metrics``: name -> float, the same
    on every rank; ``finite``: False when a non-finite value stopped the step's optimizer
    steps (the same on every rank); ``nonfinite``: then the diagnostic
    ``{"what": [names], "where": {name: {"count", "trajectories"}}, "phase": str}``.
    ``ValueError`` naming the field when one breaks this contract."""

    step: int
    batch: Any  # atlas_lightning.rollout.batch.RolloutBatch
    tensors: Mapping[str, list]
    metrics: Mapping[str, float]
    finite: bool
    nonfinite: Optional[Mapping[str, Any]] = None

    def __post_init__(self) -> None:
        step = self.step
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise ValueError(f"'step' must be the 1-based RL step (an int >= 1), got {step!r}")
        if not isinstance(self.finite, bool):
            raise ValueError(f"'finite' must be a bool, got {self.finite!r}")
        if not hasattr(self.batch, "records"):
            raise ValueError(f"'batch' must be a RolloutBatch (with .records), got {type(self.batch).__name__}")
        if getattr(self.batch, "step", step) != step:
            raise ValueError(f"'step' is {step} but its batch is of step {self.batch.step}")
        if not isinstance(self.tensors, Mapping):
            raise ValueError(f"'tensors' must be a dict name -> list of arrays, got {type(self.tensors).__name__}")
        if not isinstance(self.metrics, Mapping):
            raise ValueError(f"'metrics' must be a dict of floats, got {type(self.metrics).__name__}")
        if not self.finite and not isinstance(self.nonfinite, Mapping):
            raise ValueError(f"'finite' is False but 'nonfinite' is {self.nonfinite!r}, not the diagnostic dict")

    @property
    def records(self) -> list:
        return list(self.batch.records)

    # -- the mapping Lightning needs ----------------------------------------------------------

    def __getitem__(self, key: str) -> Any:
        if key not in _FIELDS:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(_FIELDS)

    def __len__(self) -> int:
        return len(_FIELDS)

    def copy(self) -> "StepOutput":
        """Itself: it is immutable (Lightning copies a step's output before handing it on)."""
        return self


_FIELDS = tuple(f.name for f in fields(StepOutput))


def read_step_output(outputs: Any, hook: str = "on_train_batch_end") -> StepOutput:
    """The typed step output; ``ValueError`` naming the hook and the broken key otherwise."""
    if isinstance(outputs, StepOutput):
        return outputs
    where = f"{hook}: the training_step output"
    if not isinstance(outputs, Mapping):
        raise ValueError(f"{where} must be the step-output dict (a StepOutput), got {type(outputs).__name__}")
    missing = [key for key in REQUIRED_KEYS if key not in outputs]
    if missing:
        raise ValueError(f"{where} lacks key(s) {', '.join(missing)} (has: {', '.join(sorted(map(str, outputs)))})")
    try:
        return StepOutput(**{key: outputs[key] for key in _FIELDS if key in outputs})
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
