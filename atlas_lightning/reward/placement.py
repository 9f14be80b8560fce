"""Where each reward piece lands on the response tokens (README, "The reward"), from the event log alone.

Pieces and their slots (response-token positions, the same offsets the runtime was told):

- ``explore_reward_k`` (one per charged explore) on the last token of the assistant turn that
  called the k-th explore: ``offsets[1] - 1`` of that explore event;
- ``terminal_reward`` on the last generated token: the terminal event's ``last_generated``.

Can two pieces share a slot? Two explore pieces never do: one call is executed per turn and turns
do not overlap. The terminal piece shares a slot with ``explore_reward_k`` exactly when the episode
ended on the turn that made the k-th explore: by ``max_turns`` (an explore on the last allowed
turn), or by ``stop("response_length" | "context_overflow")`` right after an explore turn whose
response did not fit. A ``submitted``, ``no_tool_call`` or ``malformed_call`` ending is a turn
without a charged explore, so its slot is its own. A shared slot holds the sum of its pieces
(explore first, then terminal) and is *one* reward event; ``pieces`` in the trace names both.

Reward events and mapped slots (the invariants in ``invariants.py``):

- the *reward events* of an episode are its distinct designated slots: one per charged explore
  plus one for the terminal piece, minus one when the two coincide as above;
- a *mapped slot* is a position of the float32 per-token reward array PPO receives
  (``token_level_rewards``) that holds a non-zero value; ``invariants.py`` compares them with
  the events of non-zero value (a zero-valued event leaves no trace a dense array can show).

``place_rewards`` puts one trace entry on every reward event's slot, even when its value is 0
(a $0.00 candidate, a wrong submit), and the sum of the trace's values is exactly
``final_reward`` (which ``breakdown.py`` defines as the correctly rounded sum of these slot
values). The only piece that can go unplaced is the terminal piece of an episode that generated
no token at all (``last_generated`` null): it is listed in ``unplaced``; the package's breakdown
gives it 0 there (no submit is possible and the shaping is not applied), and a scorer that gives
it another value shows up in ``mapping_sum_error``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from atlas_lightning.reward.events import EventLog, read_event_log


def designated_slots(log: EventLog) -> tuple[list[tuple[int, list[str]]], list[str]]:
    """``(slots, unplaced)``: ``slots`` is ``[(offset, [piece names])]`` sorted by offset, one entry
    per reward event; ``unplaced`` names pieces with no token to land on."""
    by_offset: dict[int, list[str]] = {}
    for event in log.explores:
        by_offset.setdefault(event["offsets"][1] - 1, []).append(f"explore_reward_{event['explore_k']}")
    unplaced: list[str] = []
    last = log.terminal.get("last_generated")
    if last is None:
        unplaced.append("terminal_reward")
    else:
        by_offset.setdefault(last, []).append("terminal_reward")
    return sorted(by_offset.items()), unplaced


def slot_value(pieces: list[str], values: Mapping[str, float]) -> float:
    """One slot's value: the correctly rounded sum of its pieces' values."""
    return math.fsum(values[name] for name in pieces) + 0.0  # + 0.0: no -0.0 in records


def place_rewards(episode: Mapping[str, Any], breakdown: Mapping[str, float]) -> dict:
    """The record's ``reward_trace``: ``{"offsets": [int], "values": [float], "pieces": [[str]],
    "unplaced": [str]}``, offsets ascending and unique. ``breakdown`` supplies the piece values
    (``explore_reward_k``, ``terminal_reward``) computed by ``reward_breakdown``."""
    slots, unplaced = designated_slots(read_event_log(episode))
    return {
        "offsets": [offset for offset, _ in slots],
        "values": [slot_value(pieces, breakdown) for _, pieces in slots],
        "pieces": [pieces for _, pieces in slots],
        "unplaced": unplaced,
    }


def token_level_rewards(trace: Mapping[str, Any], response_length: int) -> np.ndarray:
    """The trace as a dense ``(response_length,)`` float32 array (zeros elsewhere): exactly what
    PPO receives (float32, the dtype of its token rewards), so that the invariants
    (``invariants.py``) are measured on it. Each value is rounded once to float32.
    ``ValueError`` if an offset falls outside the response or appears twice.
    """
    offsets, values = list(trace["offsets"]), list(trace["values"])
    if len(offsets) != len(values):
        raise ValueError(f"reward_trace: {len(offsets)} offsets but {len(values)} values")
    if len(set(offsets)) != len(offsets):
        raise ValueError(f"reward_trace: repeated offsets {offsets}")
    rewards = np.zeros(int(response_length), dtype=np.float32)
    for offset, value in zip(offsets, values):
        if not 0 <= offset < response_length:
            raise ValueError(f"reward_trace: offset {offset} outside the response (length {response_length})")
        rewards[offset] = value
    return rewards
