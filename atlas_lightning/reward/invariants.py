"""The two reward invariants logged every step (SPEC section 4), per trajectory and per batch.

Per trajectory (definitions of *reward event* and *mapped slot* in ``placement.py``):

- ``mapping_sum_error`` = | sum of the placed values - ``final_reward`` |;
- ``mapped_slots_minus_events`` = (number of mapped slots) - (number of reward events).

Both are 0 for every episode whose trace came from ``place_rewards``. They are worth logging
because they recompute the expectation from the event log and compare it with what was actually
placed: pass the dense per-token rewards PPO trains on (``token_rewards``) and a dropped or
doubled reward, or a stray nonzero value, shows up. A reward moved onto another free token
changes neither number: these are sanity checks, not proofs.

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
    token_rewards: np.ndarray | None = None,
) -> dict:
    """``{"mapping_sum_error": float, "mapped_slots_minus_events": int}`` for one trajectory.

    ``token_rewards``: optional ``(response_length,)`` dense rewards; when given, the mapped slots
    are the trace offsets plus every nonzero position of it, and the sum is taken over it.
    """
    slots, _ = designated_slots(read_event_log(episode))
    mapped = set(int(o) for o in trace["offsets"])
    if token_rewards is None:
        placed_sum = math.fsum(float(v) for v in trace["values"])
    else:
        dense = np.asarray(token_rewards, dtype=np.float64)
        if dense.ndim != 1:
            raise ValueError(f"token_rewards must be 1-D (response_length,), got shape {dense.shape}")
        mapped |= set(np.flatnonzero(dense).tolist())
        placed_sum = math.fsum(dense.tolist())
    return {
        "mapping_sum_error": abs(placed_sum - float(breakdown["final_reward"])),
        "mapped_slots_minus_events": len(mapped) - len(slots),
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
