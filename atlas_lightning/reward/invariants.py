"""The two reward invariants logged every step (README, "How one RL step runs"), per trajectory
and per batch, measured on what PPO actually receives: the float32 per-token reward array of the
trajectory (``placement.token_level_rewards``; ``RolloutBatch.padded("token_rewards")`` copies
it into the step's ``(bs, response_length)`` float32 tensor unchanged).

Per trajectory, with ``r`` that float32 array, the scorer's ``reward_trace`` (offsets ``o_i``,
values ``v_i``) and the runtime's reward events (``placement.designated_slots``: each charged
explore's turn end and the last generated token, from the event log alone):

- ``mapping_sum_error`` = | (sum_t r[t] - sum_i f32(v_i)) + (sum_i v_i - final_reward) |: what
  PPO receives against the trace rounded once to float32 (the dtype PPO trains on; an exact
  ``math.fsum``), plus the trace against ``final_reward`` (the values' correctly rounded sum,
  which is how ``breakdown.py`` defines ``final_reward``). The float32 rounding of
  the values themselves (at most half a float32 ulp each, ~1e-8 for these rewards) is a
  property of the dtype, not of the mapping, and is not counted: the error is 0 exactly on
  every clean episode. A reward piece the trace could not place (a terminal reward with no
  generated token, listed in ``unplaced``) shows here.
- ``mapped_slots_minus_events`` = (mapped slots) - (reward events), where a *mapped slot* is a
  position where PPO receives a non-zero reward, or where the trace places a reward that is 0
  in float32. The second kind is a reward event of value exactly 0 (a $0.00 candidate's explore,
  a wrong submit with no shaping): the token it sits on receives nothing, so no dense array can
  tell it from no event at all, and the trace is its only record; ``place_rewards`` writes one
  trace entry on every event, values 0 included.

A non-zero reward dropped on its way to the tokens moves BOTH numbers (one slot fewer, the sum
short by its value); a stray non-zero value moves both the other way; a value altered in place
moves the sum; a reward moved onto another free token changes neither (these are sanity checks,
not proofs). A scorer (``scorer.py``) that places a reward off the events, or none on one,
moves the count too.

Per batch (``batch_invariants``): ``reward/mapping_sum_error_max`` is the largest error;
``reward/mapped_slots_minus_events_max`` is the per-trajectory value of largest magnitude with its
sign kept, so that a dropped reward (-1) is as visible as a stray one (+1).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

import numpy as np

from atlas_lightning.reward.events import read_event_log
from atlas_lightning.reward.placement import designated_slots


def trajectory_invariants(
    episode: Mapping[str, Any],
    breakdown: Mapping[str, float],
    trace: Mapping[str, Any],
    token_rewards: np.ndarray,
) -> dict:
    """``{"mapping_sum_error": float, "mapped_slots_minus_events": int}`` for one trajectory
    (module doc). ``token_rewards``: the ``(response_length,)`` float32 array PPO receives;
    ``ValueError`` for any other array (a float64 twin is not what PPO sees)."""
    dense = np.asarray(token_rewards)
    if dense.ndim != 1 or dense.dtype != np.float32:
        raise ValueError(f"token_rewards must be the 1-D float32 array PPO receives, got {dense.dtype} "
                         f"of shape {dense.shape}")
    slots, _ = designated_slots(read_event_log(episode))
    values = [float(v) for v in trace["values"]]
    rounded = [float(np.float32(v)) for v in values]
    received = dense.astype(np.float64).tolist()
    error = math.fsum(received + [-v for v in rounded]) + (math.fsum(values) - float(breakdown["final_reward"]))
    mapped = set(np.flatnonzero(dense).tolist())
    mapped |= {int(o) for o, v in zip(trace["offsets"], rounded) if v == 0.0}
    return {"mapping_sum_error": abs(error), "mapped_slots_minus_events": len(mapped) - len(slots)}


def batch_invariants(rows: Iterable[Mapping[str, float]]) -> dict:
    """Aggregate ``trajectory_invariants`` rows into the two logged metrics (0 for no rows)."""
    errors, differences = [], []
    for row in rows:
        errors.append(float(row["mapping_sum_error"]))
        differences.append(int(row["mapped_slots_minus_events"]))
    return {
        "reward/mapping_sum_error_max": max(errors, default=0.0),
        "reward/mapped_slots_minus_events_max": max(differences, key=abs, default=0),
    }
