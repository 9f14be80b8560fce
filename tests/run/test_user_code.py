"""The user's own code a fit calls (``run/user_code.py``): an error raised in a reward scorer or a
callback the config names, or a scorer's output that breaks the contract, is a clean stop naming
the key, the object and the user's line (exit 8, the traceback in the run's log); an error of this
package's code is not blamed on the user. Inside a real fit: ``tests/e2e/test_faults.py``."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from atlas_lightning.errors import RunStopped
from atlas_lightning.reward.scorer import score_trajectory
from atlas_lightning.run.faults import stops_cleanly
from atlas_lightning.run.user_code import blame, user_code
from tests.e2e.user_code import RaisingCallback, RaisingReward

REWARD = "tests.e2e.user_code.RaisingReward"
CALLBACK = "tests.e2e.user_code.RaisingCallback"


def _cfg(reward: str = REWARD):
    return OmegaConf.create({
        "reward": {"_target_": reward, "cost_per_usd": 1.0},
        "callbacks": {"progress": {"_target_": "atlas_lightning.callbacks.progress.ProgressCallback"},
                      "boom": {"_target_": CALLBACK, "step": 2}, "off": None}})


def test_the_users_code_is_what_the_config_names_outside_the_package():
    assert [(c.key, c.target) for c in user_code(_cfg())] == [("reward._target_", REWARD),
                                                             ("callbacks.boom._target_", CALLBACK)]
    assert [c.key for c in user_code(_cfg("atlas_lightning.reward.scorer.CostReward"))] == ["callbacks.boom._target_"]


def _raised(action) -> BaseException:
    try:
        action()
    except Exception as err:
        return err
    raise AssertionError("nothing raised")


def test_a_scorer_that_raises_or_breaks_the_contract_is_blamed_on_reward_target():
    code = user_code(_cfg())
    raising = RaisingReward(1.0, step=1)
    found = blame(_raised(lambda: score_trajectory(raising, {"terminal_reason": "submit"}, 4)), code)
    assert found.code.key == "reward._target_" and "user_code.py" in found.line and "__call__" in found.line
    found = blame(_raised(lambda: score_trajectory(lambda episode: {"reward": {}}, {}, 4)), code)
    assert found.code.key == "reward._target_" and "its output checked" in found.line


def test_a_callback_that_raises_is_blamed_on_its_key_and_the_packages_errors_on_nobody():
    code = user_code(_cfg())
    batch = type("Batch", (), {"step": 2})()
    found = blame(_raised(lambda: RaisingCallback(2).on_train_batch_start(None, None, batch, 0)), code)
    assert found.code.key == "callbacks.boom._target_"
    assert blame(_raised(lambda: OmegaConf.create({}).missing.key), code) is None


def test_the_stop_names_the_key_the_line_and_the_checkpoint_exit_2(tmp_path):
    raising = RaisingReward(1.0, step=1)
    with pytest.raises(RunStopped) as stopped, \
            stops_cleanly(tmp_path, last_step=lambda: 5, user=user_code(_cfg())):
        score_trajectory(raising, {"terminal_reason": "submit"}, 4)
    stop = stopped.value
    assert stop.exit_code == 8 and stop.cause == "user_code"
    assert str(stop).startswith(f"reward._target_={REWARD} (the user's code) raised at ")
    assert "after RL step 5" in str(stop) and "ValueError: user reward refused an episode" in str(stop)
    assert "no complete checkpoint" in str(stop)


def test_a_bug_keeps_its_traceback_with_a_note_naming_where_to_resume(tmp_path):
    with pytest.raises(KeyError) as raised, stops_cleanly(tmp_path, last_step=lambda: 5, user=user_code(_cfg())):
        {}["x"]
    assert any("the run stopped after RL step 5" in note for note in raised.value.__notes__)
