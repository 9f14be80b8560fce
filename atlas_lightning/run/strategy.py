"""FSDP2 for the PPO module: Lightning's ``ModelParallelStrategy`` whose checkpoints hold the
trainable tensors only, and load back.

``PPOModule.on_save_checkpoint`` drops the frozen base from the state it saves (the base comes
from ``model.path``; a 27B base is 54 GB a step). Lightning's ``ModelParallelStrategy`` loads a
torch.distributed checkpoint by asking for EVERY key of the module, and refuses a checkpoint that
lacks one (``Missing key in checkpoint state_dict``): a run could save but never resume, and the
NaN guard could never roll back. ``TrainableStateStrategy.load_checkpoint`` loads the keys the
checkpoint holds, after checking that it holds every key the module trains (a checkpoint
missing a trainable tensor is refused, naming it), then the optimizers' states and the rest
(loops, callbacks, the data cursor) as Lightning does. A full (non-sharded) checkpoint file goes
to Lightning's own loader.

Saving is Lightning's own but for two things. ``lightning_module_state_dict`` gathers the
trainable tensors only: Lightning's copies every tensor of the module to the host
(``cpu_offload``) before the module drops the frozen ones, on the 8B shape the 16 GB base at
every checkpoint, most of the 27-36 s a checkpoint took on the H200. And the sharded state (the
module's and the optimizers') is handed over where it lives, not offloaded: the step checkpoint
copies it to the host once, in torch's stager (``callbacks/checkpoint_write.py``); offloaded
here first, it was copied twice.

Who calls it: ``run/strategy_choice.build_strategy`` (every run on GPUs, and on CPU with several
processes), tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from atlas_lightning.errors import InputError

STATE_PREFIX = "state_dict."


class CheckpointKeysError(InputError):
    """A checkpoint lacks tensors the module trains (an input that cannot be used: the CLI exits 2
    with its message, no traceback)."""


class TrainableStateStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2 over the data-parallel ranks) that resumes from the
    trainable-only checkpoints the PPO module saves (module doc)."""

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's trainable tensors (and buffers), what ``on_save_checkpoint`` keeps: this
        rank's shards where they live (not copies), or a full state gathered to rank 0's host."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = not self._save_distributed_checkpoint
        options = StateDictOptions(full_state_dict=full, cpu_offload=full, ignore_frozen_params=True)
        return get_model_state_dict(self.model, options=options)

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """This rank's shards of ``optimizer``'s state where they live (not copies); a full state
        as Lightning gathers it."""
        if not self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        from lightning.pytorch.core.optimizer import LightningOptimizer
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return get_optimizer_state_dict(self.model, optimizer)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        from lightning.fabric.strategies.fsdp import _METADATA_FILENAME
        from lightning.fabric.strategies.model_parallel import _is_sharded_checkpoint
        from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, load
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(checkpoint_path))
        if not _is_sharded_checkpoint(path):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        module = self.model
        saved = {key[len(STATE_PREFIX):] for key in FileSystemReader(str(path)).read_metadata().state_dict_metadata
                 if key.startswith(STATE_PREFIX)}
        trainable = {name for name, param in module.named_parameters() if param.requires_grad}
        missing = sorted(trainable - saved)
        if missing:
            raise CheckpointKeysError(f"checkpoint {path} lacks {len(missing)} trained tensor(s), e.g. {missing[:3]}: "
                                      f"not a checkpoint of this model and adapters")
        state = {"state_dict": get_model_state_dict(module)}
        load(state, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
        module.load_state_dict(state["state_dict"], strict=False)
        for index, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{index}"
            optim_state = {key: get_optimizer_state_dict(module, optimizer)}
            load(optim_state, checkpoint_id=path)
            set_optimizer_state_dict(module, optimizer, optim_state_dict=optim_state[key],
                                     options=StateDictOptions(cpu_offload=True))
        return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)
