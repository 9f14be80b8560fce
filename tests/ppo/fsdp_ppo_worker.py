"""One PPO step of ``PPOModule`` under Lightning at a given world size, on CPU (gloo).

Run at WORLD_SIZE ranks by ``tests/forked_ranks.py`` (torchrun's variables: Lightning takes the
ranks as given and launches none; run alone, Lightning's own launcher re-runs it per extra rank):

    python tests/forked_ranks.py WORLD_SIZE tests/ppo/fsdp_ppo_worker.py BATCH.pkl CONFIG.yaml OUT_DIR WORLD_SIZE

``BATCH.pkl`` is a pickled ``RolloutBatch`` of the whole step; each rank trains on its share
(contiguous, sizes differing by at most one: ``data.sampler.shard``), as the datamodule gives
each rank its own trajectories. World size 1 uses the single-device strategy, more use FSDP2
through ``ModelParallelStrategy``. Rank 0 writes ``OUT_DIR/metrics.json`` and the adapters
(``OUT_DIR/actor``, ``OUT_DIR/critic``) after the step. A 5th argument ``tiers``: the model is
built as ``model.checkpoint_layers=auto`` builds it on a card, with recompute plans per
micro-batch size (``_Tiers``: on CPU ``auto`` itself chooses none), so the update switches plans
and cuts mini-batches by them as on a card.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import lightning as L
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, IterableDataset

from atlas_lightning.questions.sampler import shard
from atlas_lightning.ppo.module import PPOModule
from atlas_lightning.run.wiring import build_strategy


class _OneStep(IterableDataset):
    def __init__(self, dm):
        self.dm = dm

    def __len__(self):
        return 1

    def __iter__(self):
        yield self.dm.local_batch()


class _FixedBatch(L.LightningDataModule):
    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def local_batch(self):
        rank, world = self.trainer.global_rank, self.trainer.world_size
        return self.batch.subset(shard(list(range(len(self.batch))), rank, world))

    def train_dataloader(self):
        return DataLoader(_OneStep(self), batch_size=None, collate_fn=lambda b: b)


class _Capture(L.Callback):
    def __init__(self, out: Path):
        self.out = out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        # the optimizers' moments exist before the first update (ppo/optimizer_state.py)
        self.stateless = sum(not opt.optimizer.state.get(p) for opt in pl_module.optimizers()
                             for group in opt.optimizer.param_groups for p in group["params"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pl_module.save_adapters(self.out)
        if trainer.global_rank == 0:
            from torch.distributed.tensor import DTensor

            # how the module holds its model: FSDP2's DTensors where several ranks share it
            sharded = [isinstance(p, DTensor) for p in pl_module.model.parameters()]
            (self.out / "metrics.json").write_text(json.dumps({"finite": outputs["finite"], **outputs["metrics"],
                                                               "_sharded_params": sum(sharded),
                                                               "_stateless_before_update": self.stateless,
                                                               "_grads_left": sum(p.grad is not None for p in
                                                                                  pl_module.parameters()),
                                                               "_params": len(sharded)}))


class _Tiers:
    """``PPOModule``'s ``checkpoint_layers_for`` as ``run/recompute.py`` gives it on a card: the
    budget's plan (every layer whole), and smaller micro-batches' plans with their replayed shares."""

    def __init__(self, layers: int, budget: int) -> None:
        whole, half = ["layer"] * layers, ["mixer"] + ["none"] * (layers - 1)
        # sized for the test's batch: its ~1.7K-token micro-batches switch to the middle plan
        self.tiers = [(budget, tuple(whole), 1.0), (budget * 72 // 100, tuple(half), 0.2),
                      (budget * 40 // 100, ("none",) * layers, 0.0)]

    def __call__(self, device, random_base=None):
        return self.tiers[0][1]


def main() -> None:
    batch_path, config_path, out, world = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    tiers = len(sys.argv) > 5 and sys.argv[5] == "tiers"
    cfg = OmegaConf.load(config_path)
    cfg.trainer.devices = world
    resolver = None
    if tiers:
        from transformers import AutoConfig

        cfg.model.gradient_checkpointing, cfg.model.checkpoint_layers = True, "auto"
        layers = AutoConfig.from_pretrained(cfg.model.path).num_hidden_layers
        resolver = _Tiers(layers, int(cfg.algorithm.ppo_max_token_len_per_gpu))
    with open(batch_path, "rb") as handle:
        batch = pickle.load(handle)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=build_strategy(cfg), max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[_Capture(out)])
    trainer.fit(PPOModule(cfg, checkpoint_layers_for=resolver), datamodule=_FixedBatch(batch))


if __name__ == "__main__":
    main()
