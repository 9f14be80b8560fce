"""The RL events beyond Lightning's own hooks, and what the checkpoint callbacks need of the module.

``RLCallback`` is a Lightning callback that also hears three events of a run. The callback
that raises an event calls it on every callback of ``trainer.callbacks`` that is an
``RLCallback`` (``rl_callbacks``); the defaults do nothing, so a subclass overrides only what
it needs:

==========================  ==================================  ======================================
event                       raised by                           when, on which ranks
==========================  ==================================  ======================================
``on_checkpoint_saved``     ``StepCheckpoint`` (checkpoint.py)  ``global_step_N/`` is complete (marker
                                                                written; heard at a later step's end
                                                                when written in the background); every
                                                                rank
``on_rl_weights_restored``  ``NaNGuardCallback`` (rollback)     the trainer's weights were rolled back
                                                                to ``global_step_M``; every rank
``on_rl_validation_end``    ``ValidationCallback``              validation of step N is logged; every
                                                                rank (``rows`` on rank 0 only)
==========================  ==================================  ======================================

``Checkpointable`` is what ``StepCheckpoint`` (``snapshot_adapters``) and the NaN guard's rollback
(``restore_checkpoint``, then ``sync_weights``) call on the LightningModule; ``PPOModule``
implements it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Protocol, runtime_checkable

import lightning as L


class RLCallback(L.Callback):
    """A Lightning callback that also hears the RL events of the module table."""

    def on_checkpoint_saved(self, trainer: Any, step_dir: Path, step: int) -> None:
        """``step_dir`` (``checkpoints/<name>/global_step_<step>``) is a complete checkpoint."""

    def on_rl_weights_restored(self, trainer: Any, pl_module: Any, step: int, checkpoint: Path) -> None:
        """The NaN guard met a non-finite step ``step`` and restored the trainable tensors and
        optimizer states of ``checkpoint`` (a ``global_step_M`` folder, M < step); the engines
        already serve them (weights version M: the guard called ``pl_module.sync_weights``)."""

    def on_rl_validation_end(self, trainer: Any, pl_module: Any, step: int, metrics: dict,
                             rows: Optional[list]) -> None:
        """Validation of step ``step`` logged ``metrics``; ``rows``: the per-trajectory rows
        (``reward.summary.trajectory_row``) on rank 0, None elsewhere."""


def rl_callbacks(trainer: Any, *, besides: Any = None) -> list[RLCallback]:
    """The ``RLCallback``s of ``trainer.callbacks`` in their order (not ``besides``)."""
    return [c for c in trainer.callbacks if isinstance(c, RLCallback) and c is not besides]


@runtime_checkable
class Checkpointable(Protocol):
    """What the step checkpoint and the NaN guard's rollback ask of the LightningModule."""

    def snapshot_adapters(self, into: Any = None) -> Callable[[Path], None]:
        """Both adapters copied to the host now (collective), and a function that writes those
        copies as ``step_dir/{actor,critic}/lora_adapter/`` later, from any thread, with no
        collective (rank 0 writes; elsewhere it does nothing): the step checkpoint's adapters.
        ``into``: host buffers the step checkpoint keeps for the run (``models/adapters.HostBuffers``),
        for the copies to reuse (what they held is no longer read); copying anew is also right."""

    def restore_checkpoint(self, step_dir: Path) -> None:
        """The trainable tensors and optimizer states of checkpoint folder ``step_dir``, in
        place. Collective."""

    def sync_weights(self, version: int, log_step: Optional[int] = None) -> dict:
        """The engines serve the module's actor as weights version ``version`` (its metrics
        logged at RL step ``log_step``, default ``version``). Collective."""
