"""What a step cost in cards, beside its explores' dollars (``ppo/metrics.cost_metrics``), against
arithmetic by hand; and it reaches the step's metrics in a real fit's artifacts."""

from __future__ import annotations

import math

from atlas_lightning.ppo.metrics import cost_metrics


def test_card_cost_and_explore_dollars_per_step_and_per_trajectory():
    out = cost_metrics(step_seconds=90.0, cards=8, gpu_hour_usd=3.0, trajectories=1024.0,
                       explore_usd_per_trajectory=0.37)
    assert out["cost/gpu_seconds"] == 720.0 and math.isclose(out["cost/gpu_usd"], 720.0 / 3600 * 3.0)
    assert math.isclose(out["cost/gpu_usd_per_trajectory"], 0.6 / 1024)
    assert math.isclose(out["cost/gpu_seconds_per_trajectory"], 720.0 / 1024)
    assert math.isclose(out["cost/explore_usd"], 0.37 * 1024) and out["cost/explore_usd_per_trajectory"] == 0.37
    assert "cost/explore_usd" not in cost_metrics(1.0, 1, 0.0, 0.0, None)
