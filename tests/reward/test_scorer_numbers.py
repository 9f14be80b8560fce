"""Every number a reward scorer returns is finite: the reward trace's values (what PPO receives)
and every numeric field of the breakdown, the required ones and the scorer's own. A NaN there used
to pass the scorer's check, train a step on it, and end the run with exit 1 and a traceback when
the step's records (or the NaN guard's diagnostic) refused to write it. It is now the scorer's
output breaking the contract: a clean stop blamed on ``reward._target_`` (exit 8)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from omegaconf import OmegaConf

from atlas_lightning.errors import RunStopped
from atlas_lightning.reward.scorer import REQUIRED_FIELDS, score_trajectory
from atlas_lightning.run.faults import stops_cleanly
from atlas_lightning.run.user_code import user_code

_GOOD = {key: 0.5 for key in REQUIRED_FIELDS}


class Scorer:
    """Returns the breakdown and trace it was given."""

    def __init__(self, breakdown=None, values=(1.0,)):
        self.breakdown = dict(_GOOD, **(breakdown or {}))
        self.values = list(values)

    def __call__(self, episode):
        return {"reward": dict(self.breakdown),
                "reward_trace": {"offsets": list(range(len(self.values))), "values": list(self.values)}}


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, np.float32("nan"), None, "0.5"])
def test_a_trace_value_that_is_no_finite_number_is_refused_naming_it(value):
    with pytest.raises(ValueError, match=r"^reward scorer Scorer on trajectory t/n001: "
                                         r"reward_trace\['values'\]\[1\] must be a finite number, got "):
        score_trajectory(Scorer(values=[0.25, value]), {}, 4, where="trajectory t/n001")


@pytest.mark.parametrize("key, value", [("explore_reward_1", math.nan), ("mine", math.inf),
                                        ("mine", np.float64("-inf")), ("acc", math.nan)])
def test_a_non_finite_breakdown_field_is_refused_required_or_not(key, value):
    with pytest.raises(ValueError, match=rf"^reward scorer Scorer on t: reward\['{key}'\] must be a finite number"):
        score_trajectory(Scorer({key: value}), {}, 4, where="t")


def test_finite_numbers_and_fields_of_other_kinds_pass(build):
    from atlas_lightning.env.episode import Episode, RuntimeConfig
    from atlas_lightning.reward import CostReward

    ep = Episode(build.question(), 0, RuntimeConfig(max_explores=8, max_turns=3), seed=0)
    build.run(ep, [build.call("submit", {"answer": "B"})])
    cost = CostReward(1.0, -1.0)

    def scorer(episode):
        scored = cost(episode)
        scored["reward"].update(mine=np.float32(2.0), note="text", flag=True)
        return scored

    scored = score_trajectory(scorer, ep.to_record_episode(), 20)
    assert scored.reward["mine"] == 2.0 and scored.reward["note"] == "text"
    assert np.isfinite(scored.token_rewards).all()


def test_a_nan_from_the_users_scorer_stops_with_exit_8_naming_it(tmp_path):
    cfg = OmegaConf.create({"reward": {"_target_": f"{__name__}.Scorer"}, "callbacks": {}})
    with pytest.raises(RunStopped) as stopped, stops_cleanly(tmp_path, last_step=lambda: 3, user=user_code(cfg)):
        score_trajectory(Scorer(values=[math.nan]), {}, 4)
    assert stopped.value.exit_code == 8 and stopped.value.cause == "user_code"
    assert str(stopped.value).startswith(f"reward._target_={__name__}.Scorer (the user's code)")
    assert "must be a finite number, got nan" in str(stopped.value)
