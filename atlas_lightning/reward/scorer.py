"""The reward scorer: what turns an ended episode into the rewards PPO trains on, and its contract.

A run's scorer is chosen by ``reward._target_`` and built with the other ``reward`` keys as
keyword arguments (``build_scorer``): ``cost_per_usd`` and ``no_submit_reward`` always (the run's
lambda and no-submit shaping, typed by the schema), plus any keys of its own
(``+reward.my_key=...``). The package's scorer is ``CostReward`` (``conf/reward/cost.yaml``); a
scorer of your own lives in your package and is named by its path, e.g.
``reward._target_=my_pkg.rewards.MyReward``; nothing in this package changes.

Contract of a scorer: ``scorer(episode) -> {"reward": breakdown, "reward_trace": trace}``.

* ``episode``: the ended episode's record (``Episode.to_record_episode()``: the runtime's event
  log, terminal reason, token counts; the record's ``episode`` field, README, "On-disk layout").
  Every position in it is a response-token offset.
* ``breakdown``: a dict of plain numbers, written as the record's ``reward``. It must hold
  ``training_reward`` (the scalar PPO receives: the record's ``reward_score``), ``final_reward``
  (what the placed rewards add up to) and the fields validation and the figures read:
  ``acc``, ``objective``, ``cost``, ``cost_total`` (dollars), ``num_explores``. Every numeric
  field is logged as ``reward/<field>`` (its mean over the step's trajectories).
* ``trace``: ``{"offsets": [int], "values": [float], ...}``, offsets unique and inside the
  response: the reward on each of those response tokens, zero elsewhere. Written as the
  record's ``reward_trace``.

What the framework does with it (``score_trajectory``, called by ``rollout.batch.assemble_batch``
for every trajectory): checks the contract (``ValueError`` naming the scorer, the trajectory and
the field), spreads the trace into the dense float32 per-token rewards PPO receives
(``placement.token_level_rewards``) and computes the two invariants on those (``invariants.py``):
``mapping_sum_error`` (their sum against ``final_reward``, the float32 rounding of the trace's
values aside) and ``mapped_slots_minus_events`` (the positions holding a non-zero reward, and
the trace's zero-valued entries, against the runtime's reward events: each charged explore's
turn end and the last generated token, ``placement.designated_slots``). A scorer that places
a reward elsewhere, or none on a reward event, shows in ``reward/mapped_slots_minus_events_max``
every step: put a zero on an event that earns nothing (``placement.place_rewards`` does).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from atlas_lightning.reward.breakdown import reward_breakdown
from atlas_lightning.reward.invariants import trajectory_invariants
from atlas_lightning.reward.placement import place_rewards, token_level_rewards

#: ``scorer(episode) -> {"reward": breakdown, "reward_trace": trace}`` (module doc).
RewardScorer = Callable[[Mapping[str, Any]], Mapping[str, Any]]

#: Breakdown fields the framework reads (module doc).
REQUIRED_FIELDS = ("training_reward", "final_reward", "acc", "objective", "cost", "cost_total", "num_explores")


class CostReward:
    """The cost-aware reward (``breakdown.py``'s table, ``placement.py``'s slots): ``acc`` on the
    last generated token, ``-cost_per_usd`` x each charged explore's dollars on the last token of
    that explore's turn, ``no_submit_reward`` added when the episode ends without a submit."""

    def __init__(self, cost_per_usd: float, no_submit_reward: float = 0.0) -> None:
        self.cost_per_usd = float(cost_per_usd)
        self.no_submit_reward = float(no_submit_reward)

    def __call__(self, episode: Mapping[str, Any]) -> dict:
        breakdown = reward_breakdown(episode, self.cost_per_usd, self.no_submit_reward)
        return {"reward": breakdown, "reward_trace": place_rewards(episode, breakdown)}

    def __repr__(self) -> str:
        return f"CostReward(cost_per_usd={self.cost_per_usd}, no_submit_reward={self.no_submit_reward})"


@dataclass(frozen=True)
class ScoredTrajectory:
    """One trajectory as scored: ``reward`` (breakdown) and ``reward_trace`` as the scorer gave
    them, ``token_rewards`` (float32, one a response token: what PPO receives) and ``invariants``."""

    reward: dict
    reward_trace: dict
    token_rewards: np.ndarray
    invariants: dict


def _name(scorer: Any) -> str:
    return getattr(scorer, "__qualname__", None) or type(scorer).__qualname__


def score_trajectory(scorer: RewardScorer, episode: Mapping[str, Any], response_length: int,
                     where: str = "trajectory") -> ScoredTrajectory:
    """Score one ended episode with ``scorer`` and derive what PPO receives (module doc).
    ``ValueError`` naming the scorer, ``where`` and the field when the output breaks the contract."""
    scored = scorer(episode)
    prefix = f"reward scorer {_name(scorer)} on {where}"
    if not isinstance(scored, Mapping) or "reward" not in scored or "reward_trace" not in scored:
        raise ValueError(f"{prefix}: must return {{'reward': breakdown, 'reward_trace': trace}}, "
                         f"got {type(scored).__name__}{' with keys ' + str(sorted(scored)) if isinstance(scored, Mapping) else ''}")
    breakdown, trace = scored["reward"], scored["reward_trace"]
    if not isinstance(breakdown, Mapping):
        raise ValueError(f"{prefix}: 'reward' must be a dict of numbers, got {type(breakdown).__name__}")
    missing = [key for key in REQUIRED_FIELDS if key not in breakdown]
    if missing:
        raise ValueError(f"{prefix}: the breakdown lacks {', '.join(missing)}")
    for key in REQUIRED_FIELDS:
        value = breakdown[key]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"{prefix}: reward[{key!r}] must be a finite number, got {value!r}")
    for key, value in breakdown.items():  # every number, required or not: the records hold them all
        if _is_number(value) and not math.isfinite(value):
            raise ValueError(f"{prefix}: reward[{key!r}] must be a finite number, got {value!r}")
    if not isinstance(trace, Mapping) or not isinstance(trace.get("offsets"), list) \
            or not isinstance(trace.get("values"), list):
        raise ValueError(f"{prefix}: 'reward_trace' must hold lists 'offsets' and 'values'")
    for index, value in enumerate(trace["values"]):  # what PPO receives at each offset
        if not _is_number(value) or not math.isfinite(value):
            raise ValueError(f"{prefix}: reward_trace['values'][{index}] must be a finite number, got {value!r}")
    try:
        dense = token_level_rewards(trace, response_length)
    except ValueError as err:
        raise ValueError(f"{prefix}: {err}") from None
    breakdown, trace = dict(breakdown), dict(trace)
    return ScoredTrajectory(reward=breakdown, reward_trace=trace, token_rewards=dense,
                            invariants=trajectory_invariants(episode, breakdown, trace, dense))


def _is_number(value: Any) -> bool:
    """A real number (numpy's too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def build_scorer(reward_cfg: Any) -> RewardScorer:
    """The scorer of the ``reward`` config: ``reward._target_`` called with the other keys.
    ``ConfigError`` naming ``reward._target_`` when it cannot be built or is not callable."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from atlas_lightning.config import ConfigError

    target = reward_cfg.get("_target_")
    try:
        scorer = instantiate(OmegaConf.to_container(reward_cfg, resolve=True), _convert_="all")
    except Exception as err:  # a bad path or argument, named for the user
        raise ConfigError(f"reward._target_={target}: cannot build the reward scorer: {err}") from err
    if not callable(scorer):
        raise ConfigError(f"reward._target_={target}: built a {type(scorer).__name__}, which is not callable "
                          f"as scorer(episode)")
    return scorer
