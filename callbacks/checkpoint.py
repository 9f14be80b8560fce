"""Checkpoints named by the RL step: ``checkpoints/<name>/global_step_N/`` (README, "On-disk layout").

A checkpoint folder holds ``actor/lora_adapter/`` and ``critic/lora_adapter/`` (PEFT folders
that ``PeftModel.from_pretrained`` loads), ``lightning/`` (Lightning's resumable state: the
trainable tensors, optimizer states, data cursor, callbacks and loops; a torch.distributed
checkpoint folder under FSDP2, a single ``state.ckpt`` file otherwise) and, once everything
else is in place, ``checkpoint.json`` (step, files, sizes, sha256). A folder without
``checkpoint.json`` is not a checkpoint: it may hold only ``val_dumps/``, or be what a crash
left. ``latest_checkpointed_iteration.txt`` beside the folders names the newest complete one
(verl's file).

Collective: every rank takes part in the gathers and in Lightning's save; rank 0 writes the
adapters, moves files into place and writes the marker. Non-finite steps are never saved.
Once a folder is complete, every ``RLCallback`` hears ``on_checkpoint_saved`` (``base.py``).
The module must be ``Checkpointable`` (``save_adapters``), as ``PPOModule`` is.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.strategies import ModelParallelStrategy

from atlas_lightning import distributed as dist_utils
from atlas_lightning.store.atomic import atomic_write_text
from atlas_lightning.store.checkpoints import LATEST, MARKER, STATE_DIR, step_dir, write_marker
from atlas_lightning.callbacks.base import rl_callbacks
from atlas_lightning.ppo.step_output import read_step_output

class StepCheckpoint(Checkpoint):
    """Save under ``checkpoints`` (the run's ``paths.checkpoints``) every ``every_n_steps`` RL
    steps and, with ``save_last``, at the last step, ``total_steps`` (``trainer.total_steps``)."""

    def __init__(self, checkpoints: str | Path, every_n_steps: int = 5, total_steps: Optional[int] = None,
                 save_last: bool = True) -> None:
        self.checkpoints = Path(checkpoints)
        self.every_n_steps = every_n_steps
        self.total_steps = total_steps
        self.save_last = save_last
        self.last_saved: Optional[int] = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if outputs is not None and not read_step_output(outputs, "StepCheckpoint.on_train_batch_end").finite:
            return
        step = batch.step
        last = self.total_steps is not None and step == self.total_steps
        if (self.every_n_steps and step % self.every_n_steps == 0) or (self.save_last and last):
            self.save(trainer, pl_module, step)

    def save(self, trainer, pl_module, step: int) -> Path:
        checkpoints = self.checkpoints
        final = step_dir(checkpoints, step)
        tmp = checkpoints / f".tmp-global_step_{step}"
        if dist_utils.is_rank_zero():
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / STATE_DIR).mkdir(parents=True)
        dist_utils.barrier()
        pl_module.save_adapters(tmp)
        # the strategy decides the format, not the world size: FSDP2 (ModelParallelStrategy) saves a
        # torch.distributed checkpoint folder, also at world 1 (one GPU)
        distributed_state = isinstance(trainer.strategy, ModelParallelStrategy)
        trainer.save_checkpoint(tmp / STATE_DIR if distributed_state else tmp / STATE_DIR / "state.ckpt")
        dist_utils.barrier()
        if dist_utils.is_rank_zero():
            final.mkdir(parents=True, exist_ok=True)
            (final / MARKER).unlink(missing_ok=True)
            for part in ("actor", "critic", STATE_DIR):
                shutil.rmtree(final / part, ignore_errors=True)
                os.replace(tmp / part, final / part)
            shutil.rmtree(tmp, ignore_errors=True)
            write_marker(final, step)
            atomic_write_text(checkpoints / LATEST, f"{step}\n")
        dist_utils.barrier()
        self.last_saved = step
        for callback in rl_callbacks(trainer, besides=self):
            callback.on_checkpoint_saved(trainer, final, step)
        return final

    def state_dict(self) -> dict:
        return {"last_saved": self.last_saved}

    def load_state_dict(self, state: dict) -> None:
        self.last_saved = state.get("last_saved")
