"""Checkpoints named by the RL step: ``checkpoints/<name>/global_step_N/`` (README, "On-disk layout").

A checkpoint folder holds ``actor/lora_adapter/`` and ``critic/lora_adapter/`` (PEFT folders
that ``PeftModel.from_pretrained`` loads), ``lightning/`` (Lightning's resumable state: the
trainable tensors, optimizer states, data cursor, callbacks and loops; a torch.distributed
checkpoint folder under FSDP2, a single ``state.ckpt`` file otherwise) and, once everything
else is in place, ``checkpoint.json`` (step, files, sizes, sha256). A folder without
``checkpoint.json`` is not a checkpoint: it may hold only ``val_dumps/``, or be what a crash
left. ``latest_checkpointed_iteration.txt`` beside the folders names the newest complete one
(verl's file).

Written while the next step runs (``background=True``, the default): at the step's end every
rank takes host copies of the adapters and of Lightning's state (collective, the only part the
step waits for: ``timing_s/checkpoint``), then a background thread writes the files, and rank 0
moves them into place and writes the marker last (``checkpoint_write.py``). At most one save is
in flight: the next step's end waits for it (``finish_pending``, collective) before anything
else of the callback, so does fit's end (``on_train_end``, also a clean stop) and the NaN
guard before it names or restores the latest checkpoint (``wait_for_checkpoints``). Only then
is the folder complete for the run: every ``RLCallback`` hears ``on_checkpoint_saved``
(``base.py``) and ``timing_s/checkpoint_write`` (the background seconds) is logged at the step
that waited. A write that failed on any rank raises ``CheckpointWriteError`` there, on every
rank, naming the step, the folder and the error. ``background=False`` writes inline, through
the same code, before the step ends. No checkpoint is ever deleted here (there is no pruning):
the last complete one stays whatever happens to the one being written.

The host copies go into memory the callback keeps from its first save to the run's end
(``HostStaging``: pinned on CUDA, the size of what each rank stages), released at fit's end
(``on_train_end``), after an exception (``on_exception``) or at ``teardown``. Each save
overwrites the previous save's copies, which is why a save waits for the previous write first
(``save`` calls ``finish_pending`` before it stages; the staging refuses otherwise).

Non-finite steps are never saved. The module must be ``Checkpointable`` (``snapshot_adapters``),
as ``PPOModule`` is.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.callbacks import Checkpoint

from atlas_lightning import distributed as dist_utils
from atlas_lightning.errors import CheckpointWriteError  # raised here; defined below every floor
from atlas_lightning.store.checkpoints import MARKER, latest_complete
from atlas_lightning.callbacks.base import rl_callbacks
from atlas_lightning.callbacks.checkpoint_write import (BackgroundWrite, HostStaging, new_checkpoint_group, warm_staging,
                                                        stage_checkpoint, writes_sharded_state)
from atlas_lightning.ppo.step_output import read_step_output

log = logging.getLogger(__name__)

#: How long an exception's exit waits for a write in flight before leaving it unfinished (no marker).
EXIT_WAIT_S = 600.0


class StepCheckpoint(Checkpoint):
    """Save under ``checkpoints`` (the run's ``paths.checkpoints``) every ``every_n_steps`` RL
    steps and, with ``save_last``, at the last step, ``total_steps`` (``trainer.total_steps``).
    ``background``: write while the next step runs (module doc); False: before the step ends."""

    def __init__(self, checkpoints: str | Path, every_n_steps: int = 5, total_steps: Optional[int] = None,
                 save_last: bool = True, background: bool = True) -> None:
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 0:
            raise ValueError(f"StepCheckpoint: every_n_steps must be an int >= 0 (0: the last step only), "
                             f"got {every_n_steps!r}")
        self.checkpoints = Path(checkpoints)
        self.every_n_steps = every_n_steps
        self.total_steps = total_steps
        self.save_last = save_last
        self.background = background
        self.last_saved: Optional[int] = None
        self._pending: Optional[BackgroundWrite] = None
        self._group: Any = None
        #: the host memory the saves are staged in, from the first save to the run's end
        self._staging: Optional[HostStaging] = None

    def on_train_start(self, trainer, pl_module) -> None:
        """A run that will save makes its staging memory now (``warm_staging``), not in step 1."""
        if self.every_n_steps or (self.save_last and self.total_steps is not None):
            warm_staging(trainer, pl_module, self._staging_for(trainer))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = batch.step
        started = time.monotonic()
        waited = self._pending is not None
        self.finish_pending(trainer, pl_module, log_step=step)
        if outputs is not None and not read_step_output(outputs, "StepCheckpoint.on_train_batch_end").finite:
            return
        saves = self.saves_at(step)
        if saves:
            self.save(trainer, pl_module, step)
        if saves or waited:
            _log(pl_module, {"timing_s/checkpoint": time.monotonic() - started}, step)

    def saves_at(self, step: int, total_steps: Optional[int] = None) -> bool:
        """Whether RL step ``step`` is checkpointed: every ``every_n_steps`` steps, and the last
        (``total_steps``, default the callback's own) with ``save_last``."""
        total = self.total_steps if total_steps is None else total_steps
        return bool(self.every_n_steps and step % self.every_n_steps == 0) or (
            self.save_last and total is not None and step == total)

    def save(self, trainer, pl_module, step: int) -> Path:
        """Stage step ``step``'s checkpoint and write it (in the background with ``background``);
        returns its folder, complete once ``finish_pending`` has returned. Collective.

        The previous save's write ends first (``finish_pending``): this save's copies overwrite
        its host copies (``HostStaging``, which refuses otherwise)."""
        self.finish_pending(trainer, pl_module, log_step=step)
        if self._group is None and writes_sharded_state(trainer.strategy):
            self._group = new_checkpoint_group()
        write = BackgroundWrite(stage_checkpoint(trainer, pl_module, step, self.checkpoints, self._staging_for(trainer),
                                                 self._group))
        self._pending = write
        if self.background:
            write.start()
        else:
            write.run()
            self.finish_pending(trainer, pl_module, log_step=step)
        return write.staged.folder

    def finish_pending(self, trainer, pl_module, log_step: Optional[int] = None) -> None:
        """Wait for the save in flight, if any; raise ``CheckpointWriteError`` on every rank if it
        failed on any; else it is complete: log its seconds at ``log_step`` and tell every
        ``RLCallback``. Collective."""
        write, self._pending = self._pending, None
        if write is None:
            return
        write.join()
        step, folder = write.staged.step, write.staged.folder
        mine = None if write.error is None else f"rank {dist_utils.rank()}: {type(write.error).__name__}: {write.error}"
        failures = [f for f in dist_utils.gather_objects(mine) or [] if f]
        failure = dist_utils.broadcast_object(failures[0] if failures else None)
        if failure is not None:
            raise CheckpointWriteError(
                f"the checkpoint of step {step} could not be written ({failure}); {folder} has no {MARKER} and is "
                f"no checkpoint; the last complete one is {latest_complete(self.checkpoints)}") from write.error
        self.last_saved = step
        _log(pl_module, {"timing_s/checkpoint_write": write.write_s}, step if log_step is None else log_step)
        for callback in rl_callbacks(trainer, besides=self):
            callback.on_checkpoint_saved(trainer, folder, step)

    def on_train_end(self, trainer, pl_module) -> None:
        self.finish_pending(trainer, pl_module)
        self._release_staging()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """The run failed: let a write in flight finish (it is a good checkpoint of an earlier
        step), without collectives (other ranks may be gone), up to ``EXIT_WAIT_S``."""
        write, self._pending = self._pending, None
        if write is not None:
            if not write.join(EXIT_WAIT_S):
                log.warning("checkpoint of step %d still being written after %.0f s; left without its %s",
                            write.staged.step, EXIT_WAIT_S, MARKER)
            elif write.error is not None:
                log.warning("checkpoint of step %d could not be written: %s", write.staged.step, write.error)
        self._release_staging()  # Lightning calls no teardown after an exception

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self._pending is not None:  # not finished by on_train_end or on_exception: let it end, as there
            self._pending.join(EXIT_WAIT_S)
        self._release_staging()

    def _staging_for(self, trainer) -> HostStaging:
        """The run's staging memory, made at its first use."""
        if self._staging is None:
            self._staging = HostStaging(on_cuda=trainer.strategy.root_device.type == "cuda")
        return self._staging

    def _release_staging(self) -> None:
        """The staging memory goes (a write still under way keeps its copies); a later save makes it anew."""
        staging, self._staging = self._staging, None
        if staging is not None:
            staging.close()

    def state_dict(self) -> dict:
        return {"last_saved": self.last_saved}

    def load_state_dict(self, state: dict) -> None:
        self.last_saved = state.get("last_saved")


def wait_for_checkpoints(trainer, log_step: Optional[int] = None) -> None:
    """Every ``StepCheckpoint`` of ``trainer`` finishes its save in flight (``finish_pending``).
    Collective."""
    for callback in trainer.callbacks:
        if isinstance(callback, StepCheckpoint):
            callback.finish_pending(trainer, trainer.lightning_module, log_step=log_step)


def _log(pl_module, metrics: dict, step: int) -> None:
    """``metrics`` at RL step ``step`` through the module's ``log_metrics`` (rank 0 logs), if it has one."""
    log_metrics = getattr(pl_module, "log_metrics", None)
    if log_metrics is not None:
        log_metrics(metrics, step=step)
