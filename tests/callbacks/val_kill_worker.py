"""A tiny fit with validation riding with the next rollout (``callbacks.validation.overlap``) and
the real step checkpoint (every 2 steps, written before the step ends), to be killed while step 3's
rollout runs, after the checkpoint of step 2 and before step 2's validation rode
(``test_cb_validation_overlap.py``):

    python val_kill_worker.py ROOT [hold | resume]

Four steps, validation every 2. ``hold``: step 3's rollout touches ``ROOT/holding`` and sleeps
600 s. ``resume``: start from the newest checkpoint that verifies. Writes ``ROOT/result.json``:
the steps trained, the validation rollouts' steps, each validation's logged metrics (timings
left out), the checkpoint it resumed from.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cb_harness as h  # noqa: E402
import torch  # noqa: E402

from atlas_lightning.config import run_dirs  # noqa: E402
from atlas_lightning.store.checkpoints import latest_verified, lightning_state_path  # noqa: E402


def main() -> None:
    root, mode = Path(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else "")
    cfg = h.make_cfg(root, name="valkill", total_steps=4)
    folder = latest_verified(run_dirs(cfg)["checkpoints"])[0] if mode == "resume" else None
    torch.manual_seed(0)
    module = h.ScriptedModule(cfg)
    datamodule = h.ScriptedDataModule(cfg, h.make_chat())
    if mode == "hold":
        datamodule.hold_step, datamodule.hold_signal = 3, root / "holding"
    callbacks = [h.callback(cfg, "validation", val_every=2, overlap=True),
                 h.callback(cfg, "checkpoint", every_n_steps=2, background=False)]
    trainer = h.make_trainer(callbacks)
    trainer.fit(module, datamodule=datamodule, ckpt_path=str(lightning_state_path(folder)) if folder else None)
    validation = {str(step): {k: v for k, v in metrics.items() if not k.startswith("timing_s/")}
                  for step, metrics in module.logged if "gpqa/overall/acc" in metrics}
    result = {"trained": sorted(module.outputs), "val_calls": datamodule.val_calls, "validation": validation,
              "resumed_from": None if folder is None else folder.name}
    (root / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
