"""One rank of the two-process callback test (``test_cb_ddp.py``), run at two ranks by
``tests/forked_ranks.py`` (torchrun's variables; ``torch.distributed.run`` runs it the same way):

    python tests/forked_ranks.py 2 ddp_worker.py ROOT NAME NAN_STEP

Trains ``cb_harness``'s scripted module with DDP on gloo, with the four callbacks and a folder
checkpoint every 2 steps; ``NAN_STEP`` 0 means no non-finite step. Each rank writes
``ROOT/rank_<r>.json``: how it ended and what its datamodule validated.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cb_harness as h  # noqa: E402

from atlas_lightning.distributed import shut_down  # noqa: E402
from atlas_lightning.callbacks.nan_guard import NonFiniteError  # noqa: E402


def main() -> None:
    root, name, nan_step = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    cfg = h.make_cfg(root, name=name, total_steps=3)
    module = h.ScriptedModule(cfg, nan_at={nan_step} if nan_step else ())
    dm = h.ScriptedDataModule(cfg, h.make_chat())
    callbacks = [h.callback(cfg, "nan_guard"), h.callback(cfg, "artifacts"), h.callback(cfg, "validation", val_every=2),
                 h.callback(cfg, "figures"), h.FolderCheckpoint(save_every=2)]
    trainer = h.make_trainer(callbacks, devices=2, strategy="ddp")
    outcome = {"error": None}
    try:
        trainer.fit(module, datamodule=dm)
    except NonFiniteError as err:
        outcome["error"] = str(err)
    outcome.update(rank=trainer.global_rank, val_calls=dm.val_calls, logged_steps=[s for s, _ in module.logged])
    (root / f"{name}_rank_{os.environ['RANK']}.json").write_text(json.dumps(outcome))
    shut_down()  # as the CLI's verbs do: gloo torn down at exit can abort a finished process


if __name__ == "__main__":
    main()
