"""``PPOModule`` on the tiny model under FSDP2 at ``WORLD_SIZE`` ranks (gloo), on synthetic steps
(``run/memory_check.SyntheticData``: no engine), with the real step checkpoint writing every step
in the background (``test_cb_checkpoint_ppo_fsdp.py``), LoRA dropout on (each rank draws its own masks):

    python tests/forked_ranks.py 2 ppo_checkpoint_worker.py MODEL ROOT [resume]

``resume``: start from the newest checkpoint that verifies. Rank 0 writes ``ROOT/result.json``:
the checkpoint it resumed from and the RL steps trained.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
from torch.utils.data import DataLoader, IterableDataset

from atlas_lightning.callbacks.checkpoint import StepCheckpoint
from atlas_lightning.config import compose
from atlas_lightning.distributed import shut_down
from atlas_lightning.ppo.module import PPOModule
from atlas_lightning.run.memory_check import SyntheticData, vocab_size_of
from atlas_lightning.run.wiring import build_strategy
from atlas_lightning.store.checkpoints import latest_verified, lightning_state_path


class _Cursor(IterableDataset):
    def __init__(self, data: "_Steps") -> None:
        self.data = data

    def __len__(self) -> int:
        return self.data.steps

    def __iter__(self):
        while self.data.next_step <= self.data.steps:
            step = self.data.next_step
            batch = self.data.batch(step)
            self.data.next_step = step + 1
            yield batch


class _Steps(SyntheticData):
    """Synthetic steps from a data cursor, as ``RolloutDataModule`` gives them (the resume check
    asks for it)."""

    next_step = 1

    def train_dataloader(self):
        return DataLoader(_Cursor(self), batch_size=None, collate_fn=lambda batch: batch)

    def state_dict(self) -> dict:
        return {"next_step": self.next_step}

    def load_state_dict(self, state: dict) -> None:
        self.next_step = int(state["next_step"])


def main() -> None:
    model, root = sys.argv[1], Path(sys.argv[2])
    resume = len(sys.argv) > 3 and sys.argv[3] == "resume"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = compose(["experiment=tiny-cpu", f"model.path={model}", f"paths.root={root}", "name=ppo",
                   f"trainer.devices={world}", f"layout.gpus={world}", f"layout.train_gpus={world}", "model.lora.dropout=0.1",
                   "trainer.total_steps=3", "rollout.n=2", "algorithm.train_batch_size=2",
                   "algorithm.ppo_mini_batch_size=1", "algorithm.ppo_max_token_len_per_gpu=256",
                   "algorithm.forward_max_token_len_per_gpu=256"])
    checkpoints = root / "checkpoints" / "ppo"
    folder = latest_verified(checkpoints)[0] if resume else None
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=build_strategy(cfg), max_epochs=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[StepCheckpoint(checkpoints, every_n_steps=1, total_steps=3)])
    module = PPOModule(cfg, resume_from=folder)
    data = _Steps(cfg, 3, vocab_size_of(cfg), sequence_tokens=64)
    trainer.fit(module, datamodule=data, ckpt_path=str(lightning_state_path(folder)) if folder else None)
    if trainer.is_global_zero:
        result = {"resumed_from": None if folder is None else folder.name, "rl_step": module.rl_step}
        (root / "result.json").write_text(json.dumps(result))
    shut_down()


if __name__ == "__main__":
    main()
