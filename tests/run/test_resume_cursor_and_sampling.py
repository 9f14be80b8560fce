"""A checkpoint's data cursor is refused when a resume would not continue its run: a cursor that
is not the step after its RL step (the run would train steps again, or skip some), or one that
counts steps of other training questions or sampling settings than this run's (the digest the
data module keeps beside it, ``questions.sampler.sampling_digest``). A cursor written before the
digest was kept resumes as before."""

from __future__ import annotations

import re

import pytest

from atlas_lightning.config import ConfigError
from atlas_lightning.run.resume_state import ResumeStateError, check_resume_state
from atlas_lightning.store.checkpoints import MARKER, write_marker
from tests.store.test_checkpoint_verification import _checkpoint, _state_bytes


def _with_state(folder, **change):
    (folder / "lightning" / "state.ckpt").write_bytes(_state_bytes(**{"atlas": {"rl_step": 3}, **change}))
    (folder / MARKER).unlink()
    write_marker(folder, 3)
    return folder


@pytest.mark.parametrize("cursor, says", [(3, "train step(s) again"), (1, "train step(s) again"),
                                          (5, "skip step(s)")])
def test_a_cursor_that_is_not_the_next_step_is_refused(tmp_path, cursor, says):
    folder = _with_state(_checkpoint(tmp_path, 3), RolloutDataModule={"next_step": cursor})
    with pytest.raises(ResumeStateError, match=rf"RL step 3 and data cursor {cursor} .*would {re.escape(says)}"):
        check_resume_state(folder)


@pytest.mark.parametrize("kept, mine, refused", [("a" * 64, "a" * 64, False), ("a" * 64, "b" * 64, True),
                                                 (None, "b" * 64, False)], ids=["same", "other", "not-kept"])
def test_a_cursor_of_other_sampling_is_refused(tmp_path, kept, mine, refused):
    cursor = {"next_step": 4, **({"sampling": kept} if kept else {})}
    folder = _with_state(_checkpoint(tmp_path, 3), RolloutDataModule=cursor)
    if refused:
        with pytest.raises(ResumeStateError, match="its data cursor counts steps of other training questions"):
            check_resume_state(folder, sampling=mine)
    else:
        check_resume_state(folder, sampling=mine)


def test_the_run_s_own_sampling_resumes_and_other_data_settings_are_refused_before_anything_is_written(
        tmp_path, cfg_of):
    from atlas_lightning.rollout.step_questions import StepQuestions
    from atlas_lightning.run.facts import check_inputs

    cfg = cfg_of()
    digest = StepQuestions(check_inputs(cfg).questions.train, cfg).digest
    folder = _with_state(_checkpoint(tmp_path / "elsewhere", 3),
                         RolloutDataModule={"next_step": 4, "sampling": digest})
    assert check_inputs(cfg_of(f"trainer.resume={folder}")).start.resume == folder
    for override in ("data.seed=7", "rollout.n=8"):
        with pytest.raises(ConfigError, match=rf"^trainer.resume={folder}: .*other training questions"):
            check_inputs(cfg_of(f"trainer.resume={folder}", override))
    # validating a checkpoint's weights continues no sampling: other data settings are fine
    check_inputs(cfg_of(f"trainer.resume={folder}", "data.seed=7"), training=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere"]
