"""NaNGuardCallback: an injected non-finite step stops the run (or rolls it back) with the last
good checkpoint intact, nothing of the bad step dumped or checkpointed, and a diagnostic written."""

from __future__ import annotations

import json

import numpy as np
import pytest

from atlas_lightning.store.checkpoints import is_complete, latest_complete
from atlas_lightning.callbacks.nan_guard import (
    NaNGuardCallback,
    NonFiniteError,
    describe_applied,
    merge_diagnostics,
)
from atlas_lightning.config import run_dirs
from atlas_lightning.store.records import read_record, read_step_tensors, verify_manifest


def test_stop_ends_the_run_at_the_bad_step_with_the_last_good_checkpoint_intact(tmp_path, h, chat):
    cfg = h.make_cfg(tmp_path, total_steps=5)
    dirs = run_dirs(cfg)
    # Step 4 would be saved (save_every 2) and validated (val_every 4): it turns NaN.
    checkpoint = h.FolderCheckpoint(save_every=2)
    callbacks = [h.callback(cfg, "artifacts"), h.callback(cfg, "validation", val_every=4, val_before_train=False),
                 h.callback(cfg, "figures"), h.callback(cfg, "nan_guard", policy="stop"), checkpoint]
    module, dm = h.ScriptedModule(cfg, nan_at={4}), h.ScriptedDataModule(cfg, chat)
    trainer = h.make_trainer(callbacks)
    good = dirs["checkpoints"] / "global_step_2"

    with pytest.raises(NonFiniteError) as caught:
        trainer.fit(module, datamodule=dm)
    error = caught.value
    message = str(error)
    assert "step 4: non-finite actor/entropy in phase update_actor (actor/entropy: 3)" in message
    assert f"the last good checkpoint is {good}" in message and "nothing of step 4 is checkpointed" in message
    assert "no optimizer step of step 4 was applied" in message
    assert error.step == 4 and error.what == ["actor/entropy"] and error.last_good_checkpoint == good

    # Nothing of step 4: no checkpoint (the checkpoint callback runs after the guard and does not
    # check by itself here), no dump, no validation, no figure history; its update never applied.
    assert checkpoint.saved == [2]
    assert sorted(p.name for p in dirs["checkpoints"].iterdir()) == ["global_step_2"]
    assert is_complete(good) and h.snapshot(good) == checkpoint.snapshots[2]
    assert module.optimizer_steps == 3
    assert sorted(p.name for p in (dirs["artifacts"] / "train").iterdir()) == ["step_1", "step_2", "step_3"]
    assert dm.val_calls == []
    terminal = json.loads((dirs["artifacts"] / "train_figures" / "terminal_reasons.json").read_text())
    assert [s["step"] for s in terminal["steps"]] == [1, 2, 3]

    # The diagnostic and the offending trajectory's record.
    report = json.loads((dirs["artifacts"] / "nonfinite" / "step_4.json").read_text())
    first = module.outputs[4]["batch"].records[0]
    name = f"{first.uid}/{first.session_id}"
    assert report["step"] == 4 and report["what"] == ["actor/entropy"] and report["phase"] == "update_actor"
    assert report["counts"] == {"actor/entropy": 3} and report["trajectories"] == [name]
    assert report["where"]["actor/entropy"]["trajectories"] == [name]
    assert report["metrics"]["actor/entropy"] == "nan" and report["metrics"]["critic/vf_loss"] > 0
    assert report["action"] == "stop" and report["last_good_checkpoint"] == str(good)
    assert report["optimizer_steps_applied"] == {"critic": 0, "actor": 0} and report["trajectories_in_step"] == 6
    folder = dirs["artifacts"] / "nonfinite" / "step_4"
    assert verify_manifest(folder) == []
    assert [read_record(p).filename for p in folder.glob("*_*.json")] == [first.filename]
    tensors = read_step_tensors(folder / "tensors.npz")
    np.testing.assert_array_equal(tensors["values"][0], module.outputs[4]["tensors"]["values"][0])


def test_stop_without_a_checkpoint_says_so(tmp_path, h, chat):
    cfg = h.make_cfg(tmp_path, total_steps=3)
    with pytest.raises(NonFiniteError, match="step 1: .*there is no complete checkpoint to resume from") as caught:
        h.fit(cfg, chat, [h.callback(cfg, "nan_guard")], nan_at={1})
    assert caught.value.last_good_checkpoint is None


def test_rollback_restores_the_last_good_checkpoint_and_goes_on(tmp_path, h, chat):
    cfg = h.make_cfg(tmp_path, total_steps=5)
    dirs = run_dirs(cfg)
    guard = h.callback(cfg, "nan_guard", policy="rollback")
    checkpoint, listener = h.FolderCheckpoint(save_every=2), h.RestoreListener()
    _, module, _ = h.fit(cfg, chat, [h.callback(cfg, "artifacts"), guard, listener, checkpoint], nan_at={3})

    good = dirs["checkpoints"] / "global_step_2"
    assert module.restored == [good] and listener.calls == [(3, good)]
    assert module.synced == [(2, 3)]  # the engines serve the restored step-2 weights; logged at step 3
    assert (3, {"nan_guard/rollbacks": 1.0}) in module.logged
    assert module.optimizer_steps == 4 and checkpoint.saved == [2, 4]
    assert sorted(p.name for p in (dirs["artifacts"] / "train").iterdir()) == ["step_1", "step_2", "step_4", "step_5"]
    report = json.loads((dirs["artifacts"] / "nonfinite" / "step_3.json").read_text())
    assert report["action"] == "rollback" and report["last_good_checkpoint"] == str(good)
    assert guard.state_dict() == {"rollbacks": 1, "events": [
        {"step": 3, "what": ["actor/entropy"], "action": "rollback", "checkpoint": str(good)}]}


def test_rollback_stops_without_a_checkpoint_or_past_its_limit(tmp_path, h, chat):
    cfg = h.make_cfg(tmp_path, total_steps=5)
    with pytest.raises(NonFiniteError, match="step 1: .*rollback impossible: no checkpoint"):
        h.fit(cfg, chat, [h.callback(cfg, "nan_guard", policy="rollback")], nan_at={1})

    cfg = h.make_cfg(tmp_path, name="limit", total_steps=5)
    guard = h.callback(cfg, "nan_guard", policy="rollback", max_rollbacks=1)
    with pytest.raises(NonFiniteError, match="step 4: .*rollback refused: 1 rollbacks already, max_rollbacks=1"):
        h.fit(cfg, chat, [guard, h.FolderCheckpoint(save_every=2)], nan_at={3, 4})
    assert [e["action"] for e in guard.events] == ["rollback", "stop"]


def test_latest_complete_ignores_validation_only_and_unfinished_folders(tmp_path):
    def folder(name, marker=True):
        path = tmp_path / name
        (path / "actor" / "lora_adapter").mkdir(parents=True)
        if marker:
            (path / "checkpoint.json").write_text("{}")
        return path

    (tmp_path / "global_step_0" / "val_dumps").mkdir(parents=True)  # a validation dump only
    folder("global_step_2")
    folder("global_step_4", marker=False)  # a crash before the marker
    folder(".tmp-global_step_6")
    folder("global_step_10")
    (tmp_path / "global_step_10" / "val_dumps").mkdir()
    folder("global_step_x")
    assert latest_complete(tmp_path) == tmp_path / "global_step_10"
    assert latest_complete(tmp_path, before_step=10) == tmp_path / "global_step_2"
    assert latest_complete(tmp_path, before_step=2) is None
    assert latest_complete(tmp_path / "missing") is None



def test_diagnostics_of_several_ranks_merge():
    stopped = {"role": "actor", "epoch": 1, "mini_batch": 0, "mini_batches_per_epoch": 4, "epochs": 2}
    merged = merge_diagnostics([
        {"what": ["actor/entropy"], "phase": "update_actor",
         "where": {"actor/entropy": {"count": 2, "trajectories": ["q1/n000"]}},
         "optimizer_steps_applied": {"critic": 8, "actor": 4}, "stopped_at": stopped},
        None,
        {"what": ["actor/entropy", "actor/grad_norm"], "phase": "update_actor",
         "where": {"actor/entropy": {"count": 1, "trajectories": ["q7/n003", "q1/n000"]}},
         "optimizer_steps_applied": {"critic": 8, "actor": 4}, "stopped_at": stopped},
    ])
    assert merged == {"what": ["actor/entropy", "actor/grad_norm"], "phase": "update_actor",
                      "where": {"actor/entropy": {"count": 3, "trajectories": ["q1/n000", "q7/n003"]}},
                      "optimizer_steps_applied": {"critic": 8, "actor": 4}, "stopped_at": stopped}
    assert describe_applied(2, merged) == (
        "12 optimizer steps of step 2 had been applied before it (critic: 8, actor: 4); the non-finite value "
        "came in the actor update, epoch 2 of 2, mini-batch 1 of 4, whose optimizer step was not taken")


@pytest.mark.parametrize("kwargs, message", [
    ({"policy": "skip"}, "policy must be one of stop, rollback"),
    ({"max_rollbacks": -1}, "max_rollbacks must be an int >= 0"),
])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NaNGuardCallback("artifacts", "checkpoints", "run", **kwargs)
