"""The reward of README, "The reward": breakdown, placement on response tokens, invariants.

Pure Python + numpy. Everything is computed from a runtime event log (the record's ``episode``
field, ``Episode.to_record_episode()``), never from the model's text.

The rollout layer scores each ended episode with the run's scorer (``reward._target_``; the
package's is ``CostReward``; the contract in ``scorer.py``) through ``score_trajectory``;
``score_episode`` is ``CostReward``'s output with its invariants; ``batch_invariants`` and
``reward_means`` give the step's ``reward/...`` metrics.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

from atlas_lightning.reward.breakdown import RewardError, reward_breakdown
from atlas_lightning.reward.invariants import batch_invariants, trajectory_invariants
from atlas_lightning.reward.placement import place_rewards, token_level_rewards
from atlas_lightning.reward.scorer import CostReward, RewardScorer, ScoredTrajectory, build_scorer, score_trajectory


def score_episode(episode: Mapping[str, Any], cost_per_usd: float, no_submit_reward: float = 0.0) -> dict:
    """``{"reward": breakdown, "reward_trace": trace, "invariants": per-trajectory invariants}``.

    The invariants here are taken on the float32 array the trace gives over the episode's
    response (``token_counts.response``, or up to the last offset when that is later); the
    rollout recomputes them on the array it hands PPO (``rollout/batch.py``)."""
    breakdown = reward_breakdown(episode, cost_per_usd, no_submit_reward)
    trace = place_rewards(episode, breakdown)
    counted = int((episode.get("token_counts") or {}).get("response") or 0)
    length = max([counted] + [int(o) + 1 for o in trace["offsets"]])
    return {
        "reward": breakdown,
        "reward_trace": trace,
        "invariants": trajectory_invariants(episode, breakdown, trace, token_level_rewards(trace, length)),
    }


def reward_means(breakdowns: Iterable[Mapping[str, float]], prefix: str = "reward/") -> dict:
    """``{prefix + field: mean over trajectories}`` for every numeric field (``reward/acc``, ...)."""
    rows = list(breakdowns)
    if not rows:
        return {}
    # Fields every row has (explore_reward_9.. exist only where max_explores > 8).
    fields = [k for k, v in rows[0].items() if isinstance(v, (int, float)) and all(k in r for r in rows)]
    return {prefix + k: math.fsum(float(r[k]) for r in rows) / len(rows) for k in fields}


__all__ = [
    "CostReward", "RewardScorer", "ScoredTrajectory", "build_scorer", "score_trajectory", "RewardError",
    "score_episode", "reward_breakdown", "place_rewards", "token_level_rewards",
    "trajectory_invariants", "batch_invariants", "reward_means",
]
