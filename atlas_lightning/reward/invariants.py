"""The two reward invariants logged every step (README, "How one RL step runs"), per trajectory and per batch,
measured on what PPO actually receives: the float32 per-token reward array of the trajectory
(``placement.token_level_rewards``; ``RolloutBatch.padded("token_rewards")`` copies it into
the step's ``(bs, response_length)`` float32 tensor unchanged).

Per trajectory, with ``r`` that float32 array and the reward events of the event log
(``placement.designated_slots``; each event's expected value ``v_e`` is its slot's value,
``placement.slot_value``):

- ``mapping_sum_error`` = | sum_t r[t] - sum_e f32(v_e) |, both sums exact (``math.fsum`` over
  the float32 values). ``sum_e f32(v_e)`` is ``final_reward`` as PPO can receive it: each
  event's value rounded once to float32, the pieces that could not be placed (a terminal reward
  with no generated token, ``unplaced``) included, so such a piece shows here. It differs from
  the float64 ``final_reward`` by the float32 rounding of the pieces alone (at most half a
  float32 ulp of each, ~1e-8 for these rewards), which is a property of the dtype, not of the
  mapping; that is why the error is 0 exactly on every clean episode.
- ``mapped_slots_minus_events`` = (positions of ``r`` holding a non-zero value) - (reward events
  whose expected float32 value is non-zero). A reward event of value exactly 0 (a $0.00
  candidate's explore, a wrong submit with no shaping) puts nothing PPO can see on its token:
  a dense array cannot tell a zero that was placed from one that was not, so such events are
  counted on neither side (the record's ``reward_trace`` still lists them: ``place_rewards``
  puts one entry on every event's slot, values 0 included).

A non-zero reward dropped on its way to the tokens moves BOTH numbers (one slot fewer, the sum
short by its value); a stray non-zero value moves both the other way; a value altered in place
moves the sum; a reward moved onto another free token changes neither (these are sanity
checks, not proofs).

Per batch (``batch_invariants``): ``reward/mapping_sum_error_max`` is the largest error;
``reward/mapped_slots_minus_events_max`` is the per-trajectory value of largest magnitude with its
sign kept, so that a dropped reward (-1) is as visible as a stray one (+1).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

import numpy as np

from atlas_lightning.reward.events import read_event_log
from atlas_lightning.reward.placement import designated_slots, slot_value


def trajectory_invariants(
    episode: Mapping[str, Any],
    breakdown: Mapping[str, float],
    token_rewards: np.ndarray,
) -> dict:
    """``{"mapping_sum_error": float, "mapped_slots_minus_events": int}`` for one trajectory
    (module doc), from ``token_rewards``: the ``(response_length,)`` float32 array PPO receives.
    ``ValueError`` for an array that is not 1-D float32 (a float64 array is not what PPO sees)."""
    dense = np.asarray(token_rewards)
    if dense.ndim != 1 or dense.dtype != np.float32:
        raise ValueError(f"token_rewards must be the 1-D float32 array PPO receives, got {dense.dtype} "
                         f"of shape {dense.shape}")
    slots, unplaced = designated_slots(read_event_log(episode))
    expected = [float(np.float32(slot_value(pieces, breakdown))) for _, pieces in slots]
    missing = [float(np.float32(breakdown[name])) for name in unplaced]
    placed_sum = math.fsum(dense.astype(np.float64).tolist())
    return {
        "mapping_sum_error": abs(placed_sum - math.fsum(expected + missing)),
        "mapped_slots_minus_events": int(np.count_nonzero(dense)) - sum(1 for value in expected if value != 0.0),
    }


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
