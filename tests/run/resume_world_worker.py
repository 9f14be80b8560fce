"""The PPO module under FSDP2 at ``WORLD_SIZE`` ranks (gloo) on synthetic steps, saving or resuming
at a world size of its own (``test_resume_other_world_size.py``):

    python tests/forked_ranks.py W resume_world_worker.py MODEL ROOT save
    python tests/forked_ranks.py W resume_world_worker.py MODEL ROOT load

``save`` trains RL steps 1-2, a checkpoint at each. ``load`` resumes from ``global_step_2`` (its
Lightning state read whole in this process first, before any process group: the values saved),
compares every trainable tensor and every AdamW value as restored (gathered whole, at
``on_train_start``, before anything trains) with the saved ones, and with ``global_step_1``'s (a
control: those must differ), then trains step 3. Rank 0 writes ``ROOT/result.json``: the
tensors compared, those that differ, how many differ from step 1's, the RL step reached.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import warnings
from pathlib import Path

import lightning as L
import torch

from atlas_lightning.callbacks.checkpoint import StepCheckpoint
from atlas_lightning.config import compose
from atlas_lightning.distributed import shut_down
from atlas_lightning.ppo.module import PPOModule
from atlas_lightning.run.memory_check import vocab_size_of
from atlas_lightning.run.wiring import build_strategy
from atlas_lightning.store.checkpoints import lightning_state_path

STEPS = 3


def _steps_class():
    """``_Steps`` of ``tests/callbacks/ppo_checkpoint_worker.py``: synthetic steps behind a data cursor."""
    path = Path(__file__).resolve().parents[1] / "callbacks" / "ppo_checkpoint_worker.py"
    spec = importlib.util.spec_from_file_location("ppo_checkpoint_worker", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._Steps


def _saved_values(folder: Path) -> dict:
    """Every tensor of ``folder``'s torch.distributed state, whole, by its key in the metadata."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        state = _load_state_dict_from_keys(checkpoint_id=str(lightning_state_path(folder)))
    flat = {f"state_dict.{name}": value for name, value in state.get("state_dict", {}).items()}
    for key, entry in state.items():
        if key.startswith("optimizer_"):
            for param, kept in entry.get("state", {}).items():
                flat.update({f"{key}.state.{param}.{name}": value for name, value in kept.items()})
    return flat


class _Compare(L.Callback):
    """At ``on_train_start`` (after Lightning's restore, before any update) every trainable tensor
    and AdamW value gathered whole, against the saved ones."""

    def __init__(self, saved: dict, earlier: dict) -> None:
        self.saved, self.earlier, self.compared, self.differ, self.differ_from_earlier = saved, earlier, 0, [], 0

    def on_train_start(self, trainer, pl_module) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
        from torch.distributed.tensor import DTensor

        restored = {}
        for name, param in pl_module.named_parameters():
            if param.requires_grad:  # full_tensor is a collective: every rank gathers
                restored[f"state_dict.{name}"] = param.full_tensor() if isinstance(param, DTensor) else param
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole on rank 0, empty elsewhere
        for index, optimizer in enumerate(trainer.optimizers):
            state = get_optimizer_state_dict(pl_module, optimizer, options=options)
            for param, kept in state.get("state", {}).items():
                restored.update({f"optimizer_{index}.state.{param}.{name}": value for name, value in kept.items()})
        if trainer.is_global_zero:
            for key in sorted(set(self.saved) | set(restored)):
                self.compared += 1
                if not _equal(restored.get(key), self.saved.get(key)):
                    self.differ.append(key)
                self.differ_from_earlier += not _equal(restored.get(key), self.earlier.get(key))


def _equal(mine, theirs) -> bool:
    return mine is not None and theirs is not None and torch.equal(torch.as_tensor(mine).detach().cpu(),
                                                                   torch.as_tensor(theirs))


def main() -> None:
    model, root, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = compose(["experiment=tiny-cpu", f"model.path={model}", f"paths.root={root}", "name=ppo",
                   f"trainer.devices={world}", f"layout.gpus={world}", f"layout.train_gpus={world}",
                   "model.lora.dropout=0.1", f"trainer.total_steps={STEPS}", "rollout.n=2",
                   "algorithm.train_batch_size=6", "algorithm.ppo_mini_batch_size=3",
                   "algorithm.ppo_max_token_len_per_gpu=256", "algorithm.forward_max_token_len_per_gpu=256"])
    checkpoints = root / "checkpoints" / "ppo"
    folder = checkpoints / "global_step_2" if mode == "load" else None
    compare = _Compare(_saved_values(folder), _saved_values(checkpoints / "global_step_1")) if folder else None
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=build_strategy(cfg), max_epochs=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[StepCheckpoint(checkpoints, every_n_steps=1, total_steps=STEPS, background=False),
                                   *([compare] if compare else [])])
    module = PPOModule(cfg, resume_from=folder)
    steps = STEPS if folder is not None else 2
    data = _steps_class()(cfg, steps, vocab_size_of(cfg), sequence_tokens=64)
    trainer.fit(module, datamodule=data, ckpt_path=str(lightning_state_path(folder)) if folder else None)
    if trainer.is_global_zero:
        result = {"world": world, "rl_step": module.rl_step, "compared": compare.compared if compare else 0,
                  "differ": compare.differ if compare else [],
                  "differ_from_step_1": compare.differ_from_earlier if compare else 0}
        (root / "result.json").write_text(json.dumps(result))
    shut_down()


if __name__ == "__main__":
    main()
