"""The per-trajectory reward breakdown of README, "The reward", from the event log alone.

With ``lam = cost_per_usd`` (``reward.cost_per_usd``, 0.1 points per dollar) and ``c_k`` the
``charged_cost_usd`` of the k-th charged explore:

=========================  ==================================================================
field                      value
=========================  ==================================================================
acc                        1 if the submit was graded correct, else 0 (0 without a submit)
cost_total                 sum of c_k, dollars
cost                       lam * cost_total
explore_reward_k           -lam * c_k; 0 where there was no k-th explore (k = 1..max(8, max_explores))
terminal_reward            acc, plus ``no_submit_reward`` when the episode ended without a submit
                           after generating at least one token
final_reward               terminal_reward + sum_k explore_reward_k (computed as the correctly
                           rounded sum of the per-slot values of ``placement.py``, so that the
                           placed values add up to it exactly; it differs from the plain sum by at
                           most one rounding)
objective                  acc - cost (never shaped: the quantity the report compares)
training_reward            the scalar PPO receives, = final_reward (the record's reward_score)
found_correct              1 if any revealed candidate is cached correct
first_correct_k            explore_k of the first correct revealed candidate, 0 if none
submitted_after_correct    1 if it submitted after a correct candidate had been revealed
terminal_reason_code       the stable code of ``atlas_lightning.env.terminal``
submitted                  1 if the episode ended by a submit
num_explores               charged explores (revealed candidates)
num_explore_calls          explore calls, including those beyond the quota
num_turns                  assistant turns
=========================  ==================================================================

Shaping: ``no_submit_reward`` (default 0) is the only one; it enters ``terminal_reward`` and so
``final_reward`` and ``training_reward``, never ``objective``. An episode that generated no token
(a prompt that overflows the context at once) is not shaped: the shaping would have no token to
land on, PPO would never receive it, and the record must say what PPO receives. Every value is a plain int or float,
finite in float32 (the dtype PPO receives): a cost or lambda so large that a value overflows is a
``RewardError`` naming the episode and the field, never an ``OverflowError`` or an inf in training
(the question loader and the config bound both, so that this is never reached with checked inputs).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from atlas_lightning.reward.events import read_event_log
from atlas_lightning.reward.placement import designated_slots, slot_value

#: ``explore_reward_1..8`` are always present (the report's field names), more if max_explores > 8.
MIN_EXPLORE_FIELDS = 8
#: The largest finite float32: PPO receives the rewards in float32.
FLOAT32_MAX = 3.4028234663852886e38


class RewardError(ValueError):
    """A reward that cannot be computed finitely; the message names the episode and the field."""


def explore_field_count(max_explores: int) -> int:
    return max(MIN_EXPLORE_FIELDS, int(max_explores))


def reward_breakdown(episode: Mapping[str, Any], cost_per_usd: float, no_submit_reward: float = 0.0) -> dict:
    """The breakdown of one ended episode (its record's ``episode`` field); see the module table.

    ``cost_per_usd`` and ``no_submit_reward`` are plain floats (from ``RewardConfig``).
    ``ValueError`` on a non-finite or negative ``cost_per_usd`` or a broken event log;
    ``RewardError`` when a value is not finite in float32.
    """
    lam = float(cost_per_usd)
    shaping = float(no_submit_reward)
    if not math.isfinite(lam) or lam < 0:
        raise ValueError(f"cost_per_usd={cost_per_usd!r} must be a finite number >= 0")
    if not math.isfinite(shaping):
        raise ValueError(f"no_submit_reward={no_submit_reward!r} must be finite")
    log = read_event_log(episode)

    where = f"episode question_id={episode.get('question_id')!r} sample {episode.get('sample_index')!r}"
    costs = [float(e["charged_cost_usd"]) for e in log.explores]
    submitted = log.submit is not None
    acc = int(log.submit["acc"]) if submitted else 0
    try:
        cost_total = math.fsum(costs)
        pieces: dict[str, float] = {}
        for k in range(1, explore_field_count(log.max_explores) + 1):
            pieces[f"explore_reward_{k}"] = -(lam * costs[k - 1]) + 0.0 if k <= len(costs) else 0.0
        slots, unplaced = designated_slots(log)
        # An episode that generated no token has nowhere to put the shaping, and PPO receives
        # nothing from it: the record says the same (terminal_reward 0, not the shaping).
        shaped = not submitted and "terminal_reward" not in unplaced
        pieces["terminal_reward"] = float(acc) + (shaping if shaped else 0.0)
        final_reward = math.fsum([slot_value(names, pieces) for _, names in slots]
                                 + [pieces[n] for n in unplaced]) + 0.0
    except OverflowError:
        raise RewardError(f"{where}: the reward overflows (charged costs {costs} dollars at "
                          f"cost_per_usd={lam}); no finite reward exists for it") from None

    correct_ks = [e["explore_k"] for e in log.explores if e["is_correct"]]
    breakdown: dict[str, float | int] = {
        "acc": acc,
        "cost_total": cost_total,
        "cost": lam * cost_total,
    }
    breakdown.update(pieces)
    breakdown.update({
        "final_reward": final_reward,
        "objective": acc - lam * cost_total,
        "training_reward": final_reward,
        "found_correct": int(bool(correct_ks)),
        "first_correct_k": correct_ks[0] if correct_ks else 0,
        "submitted_after_correct": int(submitted and bool(correct_ks)),
        "terminal_reason_code": int(log.terminal["terminal_reason_code"]),
        "submitted": int(submitted),
        "num_explores": len(log.explores),
        "num_explore_calls": len(log.explores) + len(log.over_quota),
        "num_turns": log.num_turns,
    })
    for name, value in breakdown.items():
        if isinstance(value, float) and not abs(value) <= FLOAT32_MAX:
            raise RewardError(f"{where}: field {name}={value} is not finite in float32 (charged costs {costs} "
                              f"dollars at cost_per_usd={lam})")
    return breakdown
