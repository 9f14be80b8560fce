"""A tiny fit with the real step checkpoint (``callbacks/checkpoint.py``, background writes), to
be killed while a save is in flight (``test_cb_checkpoint_background.py``):

    python ckpt_kill_worker.py ROOT MODE SLOW_STEP [resume]
    python tests/forked_ranks.py 2 ckpt_kill_worker.py ROOT fsdp SLOW_STEP [resume]

``MODE``: ``single`` (one process, Lightning's single-file state) or ``fsdp`` (FSDP2 through
``TrainableStateStrategy`` at ``WORLD_SIZE`` ranks on gloo, a torch.distributed checkpoint).
Six steps, a checkpoint every 2. The disk is slow from ``SLOW_STEP`` on (0: never): that
save's adapter writer touches ``ROOT/writing_<step>`` and then sleeps 600 s before writing
(the rest of the save is the real one). ``resume``: start from the newest checkpoint that
verifies. Rank 0 writes ``ROOT/<MODE>-result.json``: the steps this run trained, its final
weights, the checkpoint it resumed from.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cb_harness as h  # noqa: E402
import torch  # noqa: E402

from atlas_lightning.config import run_dirs  # noqa: E402
from atlas_lightning.distributed import shut_down  # noqa: E402
from atlas_lightning.store.checkpoints import latest_verified, lightning_state_path  # noqa: E402


def main() -> None:
    root, mode, slow_step = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    resume = len(sys.argv) > 4 and sys.argv[4] == "resume"
    cfg = h.make_cfg(root, name=mode, total_steps=6)
    folder = latest_verified(run_dirs(cfg)["checkpoints"])[0] if resume else None
    ckpt_path = str(lightning_state_path(folder)) if folder else None
    torch.manual_seed(0)  # the same starting weights in every run: the resumed run must end where the straight one did
    if mode == "fsdp":
        from atlas_lightning.run.strategy import TrainableStateStrategy

        world = int(os.environ.get("WORLD_SIZE", "1"))
        module = h.sharded_module(cfg, resume_from=folder)
        options = dict(devices=world, strategy=TrainableStateStrategy(data_parallel_size=world, tensor_parallel_size=1))
    else:
        module, options = h.ScriptedModule(cfg), {}
    if slow_step:
        h.slow_disk(module, slow_step, 600.0, signals=root)
    trainer = h.make_trainer([h.callback(cfg, "checkpoint", every_n_steps=2)], **options)
    trainer.fit(module, datamodule=h.ScriptedDataModule(cfg, h.make_chat()), ckpt_path=ckpt_path)
    weight = module.critic.weight
    weight = weight.full_tensor() if hasattr(weight, "full_tensor") else weight
    if trainer.is_global_zero:
        result = {"trained": sorted(module.outputs), "resumed_from": None if folder is None else folder.name,
                  "weight": weight.detach().flatten().tolist()}
        (root / f"{mode}-result.json").write_text(json.dumps(result))
    shut_down()


if __name__ == "__main__":
    main()
