"""A fault while Lightning restores the checkpoint a run resumes from (``run/faults.py``): the
module has not recorded the checkpoint's step yet, and the stop must still name that checkpoint,
intact (a restore only reads it), as the one to resume from, on rank 0 and on the others; never
"no complete checkpoint"."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from atlas_lightning.errors import RunStopped
from atlas_lightning.run import faults
from atlas_lightning.run.faults import stops_cleanly
from tests.store.test_checkpoint_verification import _checkpoint


def _restoring(state: str, checkpoints):
    """Two complete checkpoints, and a trainer restoring step 2's state (``state``: one file, or a
    torch.distributed folder)."""
    _checkpoint(checkpoints, 1)
    second = _checkpoint(checkpoints, 2)
    path = second / "lightning" / "state.ckpt" if state == "one_file" else second / "lightning"
    return second, SimpleNamespace(ckpt_path=str(path), callbacks=[])


@pytest.mark.parametrize("state", ["one_file", "distributed"])
@pytest.mark.parametrize("rank_zero", [True, False], ids=["rank0", "rank1"])
def test_an_error_during_the_restore_names_the_checkpoint_being_restored(tmp_path, monkeypatch, state, rank_zero):
    second, trainer = _restoring(state, tmp_path)
    monkeypatch.setattr(faults.dist_utils, "is_rank_zero", lambda: rank_zero)
    with pytest.raises(RuntimeError) as raised, stops_cleanly(tmp_path, last_step=lambda: 0, trainer=trainer):
        raise RuntimeError("The size of tensor a (8) must match the size of tensor b (128)")
    said = "(verified); resume with trainer.resume=auto" if rank_zero else "(rank 0 verifies it)"
    assert raised.value.__notes__[-1] == (f"the run stopped after RL step 2 (the last one finished); the last "
                                          f"complete checkpoint is {second} {said}")


def test_a_clean_stop_during_the_restore_names_it_too(tmp_path):
    second, trainer = _restoring("distributed", tmp_path)
    with pytest.raises(RunStopped) as stopped, stops_cleanly(tmp_path, last_step=lambda: 0, trainer=trainer):
        raise torch.OutOfMemoryError("out of memory loading the state")
    assert stopped.value.last_good_checkpoint == second
    assert f"the last complete checkpoint is {second} (verified)" in str(stopped.value)


def test_a_fresh_run_still_names_no_checkpoint_of_a_later_first_attempt(tmp_path):
    """Without a restore the last step finished counts alone: folders of an earlier attempt past
    it are not this run's to resume from."""
    _checkpoint(tmp_path, 2)
    trainer = SimpleNamespace(ckpt_path=None, callbacks=[])
    with pytest.raises(RuntimeError) as raised, stops_cleanly(tmp_path, last_step=lambda: 0, trainer=trainer):
        raise RuntimeError("a bug")
    assert raised.value.__notes__[-1].endswith(f"there is no complete checkpoint under {tmp_path} to resume from")
