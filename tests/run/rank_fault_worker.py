"""One rank of a 2-rank FSDP2 fit on CPU (gloo) in which a fault strikes one rank alone.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python tests/run/rank_fault_worker.py MODEL ROOT FAULT RANK

Synthetic steps (the memory check's, ``run/memory_check.py``) through ``PPOModule`` under
``ModelParallelStrategy``, ``FaultInjection(FAULT, step=2, rank=RANK)``, inside
``run/faults.py``'s ``stops_cleanly``; a ``RunStopped`` prints the CLI's stop line and exits
with its code (``run/exit_codes.report``), as ``atlas-lightning fit`` does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
from omegaconf import OmegaConf

from atlas_lightning.callbacks.faults import FaultInjection
from atlas_lightning.config import compose
from atlas_lightning.errors import RunStopped
from atlas_lightning.ppo.module import PPOModule
from atlas_lightning.run.exit_codes import report
from atlas_lightning.run.faults import stops_cleanly
from atlas_lightning.run.memory_check import SyntheticData, vocab_size_of
from atlas_lightning.run.wiring import build_strategy


def main() -> int:
    model, root, fault, rank = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    cfg = compose(["experiment=tiny-cpu", f"model.path={model}", f"paths.root={root}",
                   "algorithm.train_batch_size=2", "algorithm.ppo_mini_batch_size=1", "algorithm.ppo_epochs=1",
                   "algorithm.ppo_max_token_len_per_gpu=128", "algorithm.forward_max_token_len_per_gpu=128",
                   "rollout.max_response_length=96", "rollout.max_prompt_length=32",
                   "rollout.max_tokens_per_turn=24"])
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))  # as fit's workers read it back
    cfg.trainer.devices = 2  # the colocated layout's checks count cards; here 2 CPU processes
    module = PPOModule(cfg)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=build_strategy(cfg), max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[FaultInjection(fault, step=2, rank=rank)])
    try:
        with stops_cleanly(root / "checkpoints", last_step=lambda: module.finished_step, trainer=trainer):
            trainer.fit(module, datamodule=SyntheticData(cfg, steps=3, vocab_size=vocab_size_of(cfg)))
    except RunStopped as err:
        return report("atlas-lightning fit", err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
