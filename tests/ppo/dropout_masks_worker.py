"""``PPOModule`` with LoRA dropout on the tiny model under FSDP2 at ``WORLD_SIZE`` ranks (gloo),
two synthetic steps that are THE SAME on every rank (rank 0's), no engine, no checkpoint; each
rank hashes every LoRA dropout mask it draws (``test_rank_seeds.py``):

    python tests/forked_ranks.py 2 dropout_masks_worker.py MODEL ROOT

Same data, same shapes: two ranks whose generators stood in the same state would draw the same
masks. Rank r writes ``ROOT/masks-<r>.json``: one sha256 a dropout call (the positions it
zeroed), in call order.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import lightning as L
import torch

from atlas_lightning.config import compose
from atlas_lightning.distributed import shut_down
from atlas_lightning.ppo.module import PPOModule
from atlas_lightning.run.memory_check import SyntheticData, synthetic_batch, vocab_size_of
from atlas_lightning.run.wiring import build_strategy

STEPS = 2


class _SameOnEveryRank(SyntheticData):
    def batch(self, step: int):
        return synthetic_batch(self.cfg, self.vocab_size, step=step, rank=0, sequence_tokens=self.sequence_tokens)


class _HashMasks(L.Callback):
    """A forward hook on every LoRA dropout module: the sha256 of the positions it zeroed."""

    def __init__(self) -> None:
        self.hashes: list[str] = []

    def on_train_start(self, trainer, pl_module) -> None:
        for name, module in pl_module.model.named_modules():
            if ".lora_dropout." in name and isinstance(module, torch.nn.Dropout):
                module.register_forward_hook(self._hash)

    def _hash(self, module, inputs, output) -> None:
        if module.training:
            zeroed = (output == 0) & (inputs[0] != 0)
            self.hashes.append(hashlib.sha256(zeroed.cpu().numpy().tobytes()).hexdigest())


def main() -> None:
    model, root = sys.argv[1], Path(sys.argv[2])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = compose(["experiment=tiny-cpu", f"model.path={model}", f"paths.root={root}", "name=masks",
                   f"trainer.devices={world}", f"layout.gpus={world}", f"layout.train_gpus={world}",
                   "model.lora.dropout=0.1", f"trainer.total_steps={STEPS}", "rollout.n=2",
                   "algorithm.train_batch_size=2", "algorithm.ppo_mini_batch_size=1",
                   "algorithm.ppo_max_token_len_per_gpu=256", "algorithm.forward_max_token_len_per_gpu=256"])
    masks = _HashMasks()
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=build_strategy(cfg), max_epochs=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[masks])
    trainer.fit(PPOModule(cfg), datamodule=_SameOnEveryRank(cfg, STEPS, vocab_size_of(cfg), sequence_tokens=64))
    (root / f"masks-{trainer.global_rank}.json").write_text(json.dumps(masks.hashes))
    shut_down()


if __name__ == "__main__":
    main()
