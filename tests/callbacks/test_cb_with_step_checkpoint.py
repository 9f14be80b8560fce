"""The callbacks beside the real checkpoint callback (``callbacks/checkpoint.py``): validation
dumps share ``global_step_N`` with the checkpoint, the NaN guard names the checkpoint it wrote,
and a run resumed from it carries the callbacks' state on."""

from __future__ import annotations

import json

import pytest

from atlas_lightning.store.checkpoints import MARKER, latest_complete, lightning_state_path
from atlas_lightning.callbacks.nan_guard import NonFiniteError
from atlas_lightning.config import run_dirs


def _callbacks(h, cfg):
    return [h.callback(cfg, "nan_guard"), h.callback(cfg, "validation", val_every=2),
            h.callback(cfg, "figures", every_n_steps=4), h.callback(cfg, "checkpoint", every_n_steps=2)]


def test_val_dumps_live_in_the_checkpoint_folder_and_a_stop_names_it(tmp_path, h, chat):
    cfg = h.make_cfg(tmp_path, total_steps=5)
    checkpoints = run_dirs(cfg)["checkpoints"]
    with pytest.raises(NonFiniteError) as caught:
        h.fit(cfg, chat, _callbacks(h, cfg), nan_at={4})
    good = checkpoints / "global_step_2"
    assert caught.value.last_good_checkpoint == good == latest_complete(checkpoints)
    assert sorted(p.name for p in good.iterdir()) == ["actor", "checkpoint.json", "critic", "lightning", "val_dumps"]
    assert len((good / "val_dumps" / "2.jsonl").read_text().splitlines()) == 5
    assert sorted(p.name for p in (checkpoints / "global_step_0").iterdir()) == ["val_dumps"]
    assert not (checkpoints / "global_step_4").exists()
    marker = json.loads((good / MARKER).read_text())
    assert not any(name.startswith("val_dumps") for name in marker["files"])


def test_a_run_stopped_by_the_guard_resumes_from_the_named_checkpoint(tmp_path, h, chat):
    cfg = h.make_cfg(tmp_path, total_steps=4)
    module, dm = h.ScriptedModule(cfg, nan_at={3}), h.ScriptedDataModule(cfg, chat)
    with pytest.raises(NonFiniteError) as caught:
        h.make_trainer(_callbacks(h, cfg)).fit(module, datamodule=dm)
    assert dm.val_calls == [0, 2]

    state = lightning_state_path(caught.value.last_good_checkpoint)
    callbacks = _callbacks(h, cfg)
    module, dm = h.ScriptedModule(cfg), h.ScriptedDataModule(cfg, chat)
    h.make_trainer(callbacks).fit(module, datamodule=dm, ckpt_path=str(state))
    assert dm.val_calls == [4]  # no second step 0
    assert callbacks[1].validated == [0, 2, 4]
    assert [s["step"] for s in callbacks[2].history["train"]] == [1, 2, 3, 4]
    assert [s["step"] for s in callbacks[2].history["val"]] == [0, 2, 4]
