"""The separate layout's step figures (``ppo/metrics.asynchronous_metrics``): the staleness
histogram, dropped trajectories and idle shares; nothing for a synchronous step."""

from __future__ import annotations

import pytest

from atlas_lightning.config import compose
from atlas_lightning.ppo.metrics import asynchronous_metrics
from atlas_lightning.rollout.agent_loop import LoopStats
from atlas_lightning.rollout.batch import RolloutBatch
from atlas_lightning.rollout.layout_checks import separate_refusals


def _batch(**fields) -> RolloutBatch:
    return RolloutBatch(step=4, partition="train", records=[], token_rewards=[], invariants=[], stats=LoopStats(),
                        weights_version=2, **fields)


def test_histogram_drops_and_idle_shares():
    batch = _batch(staleness=1, staleness_counts={0: 3, 1: 5}, dropped=2)
    timing = {"wait_rollout": 0.5, "step": 10.0, "engine_idle": 1.0, "rollout": 3.0}
    out = asynchronous_metrics(batch, timing)
    assert out == pytest.approx({
        "rollout/staleness_hist/0": 3.0, "rollout/staleness_hist/1": 5.0, "rollout/staleness_mean": 5 / 8,
        "rollout/dropped_trajectories": 2.0, "perf/trainer_idle_share": 0.05, "perf/engine_idle_share": 0.25})


def test_a_synchronous_step_gets_none_of_them():
    assert asynchronous_metrics(_batch(staleness=0), {"rollout": 3.0, "step": 10.0}) == {}


def test_drop_with_no_staleness_allowed_is_refused():
    base = ["experiment=tiny-cpu", "layout=separate_cpu", "rollout=vllm_server_cpu", "layout.staleness_policy=drop"]
    refused = separate_refusals(compose(base + ["layout.max_staleness=0"]))
    assert any("layout.staleness_policy=drop" in p and "layout.max_staleness >= 1" in p for p in refused)
    assert separate_refusals(compose(base + ["layout.max_staleness=1"])) == []
