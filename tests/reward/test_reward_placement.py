"""Placement of reward pieces on response tokens, and the two invariants."""

import math

import numpy as np
import pytest

from atlas_lightning.env import Episode, RuntimeConfig
from atlas_lightning.reward import (
    batch_invariants,
    place_rewards,
    reward_breakdown,
    score_episode,
    token_level_rewards,
    trajectory_invariants,
)

ZERO = {"mapping_sum_error": 0.0, "mapped_slots_minus_events": 0}


def test_each_piece_on_its_turn_last_token(build):
    episode = Episode(build.question(), 0)
    # Turns of 5 tokens, responses of 7: turns at [0,5), [12,17), [24,29).
    build.run(episode, [build.call("explore"), build.call("explore"), build.call("submit", {"answer": "B"})])
    scored = score_episode(episode.to_record_episode(), 0.1)
    trace = scored["reward_trace"]
    assert trace["offsets"] == [4, 16, 28]
    assert trace["pieces"] == [["explore_reward_1"], ["explore_reward_2"], ["terminal_reward"]]
    assert trace["values"] == [-(0.1 * 0.12), -(0.1 * 0.5), 1.0]
    assert trace["unplaced"] == []
    assert math.fsum(trace["values"]) == scored["reward"]["final_reward"]
    assert scored["invariants"] == ZERO


def test_zero_valued_pieces_are_placed(build):
    # A $0.00 candidate then a wrong submit: both slots hold 0 and are still placed.
    question = build.question(costs=(0.0, 0.1, 0.1, 0.1), permutations=[(0, 1, 2, 3)])
    episode = Episode(question, 0)
    build.run(episode, [build.call("explore"), build.call("submit", {"answer": "A"})])
    scored = score_episode(episode.to_record_episode(), 0.1)
    assert scored["reward_trace"]["offsets"] == [4, 16] and scored["reward_trace"]["values"] == [0.0, 0.0]
    assert scored["invariants"] == ZERO


def test_max_turns_on_an_explore_shares_one_slot(build):
    episode = Episode(build.question(), 0, RuntimeConfig(max_turns=2))
    build.run(episode, [build.call("explore"), build.call("explore")])
    assert episode.terminal_reason == "max_turns"
    scored = score_episode(episode.to_record_episode(), 0.1, no_submit_reward=-0.25)
    trace = scored["reward_trace"]
    assert trace["offsets"] == [4, 16]
    assert trace["pieces"] == [["explore_reward_1"], ["explore_reward_2", "terminal_reward"]]
    assert trace["values"][1] == -(0.1 * 0.5) + -0.25
    assert scored["invariants"] == ZERO


def test_stop_after_an_explore_shares_one_slot(build):
    episode = Episode(build.question(), 0)
    episode.on_assistant_turn(build.call("explore"), 0, 6)
    episode.stop("context_overflow")
    scored = score_episode(episode.to_record_episode(), 0.1)
    assert scored["reward_trace"]["offsets"] == [5]
    assert scored["reward_trace"]["pieces"] == [["explore_reward_1", "terminal_reward"]]
    assert scored["invariants"] == ZERO


def test_truncated_turn_takes_the_terminal_reward(build):
    episode = Episode(build.question(), 0)
    build.run(episode, [build.call("explore")])
    episode.stop("response_length", last_generated=40, text="<tool_call>{", start=20)
    scored = score_episode(episode.to_record_episode(), 0.1)
    assert scored["reward_trace"]["offsets"] == [4, 40] and scored["invariants"] == ZERO


def test_nothing_generated_leaves_the_terminal_unplaced(build):
    episode = Episode(build.question(), 0)
    episode.stop("context_overflow")
    record = episode.to_record_episode()
    assert score_episode(record, 0.1)["invariants"] == ZERO  # terminal reward 0: nothing lost
    shaped = score_episode(record, 0.1, no_submit_reward=-0.5)
    assert shaped["reward_trace"] == {"offsets": [], "values": [], "pieces": [], "unplaced": ["terminal_reward"]}
    # no token to carry the shaping: the record says what PPO receives, and the invariants hold
    assert shaped["invariants"] == ZERO
    assert shaped["reward"]["terminal_reward"] == shaped["reward"]["final_reward"] == 0.0
    assert shaped["reward"]["training_reward"] == 0.0


def _scored(build):
    episode = Episode(build.question(), 0)
    build.run(episode, [build.call("explore"), build.call("explore"), build.call("submit", {"answer": "B"})])
    record = episode.to_record_episode()
    breakdown = reward_breakdown(record, 0.1)
    return record, breakdown, place_rewards(record, breakdown)


def test_dense_rewards(build):
    record, breakdown, trace = _scored(build)
    dense = token_level_rewards(trace, 29)
    assert dense.shape == (29,) and dense.dtype == np.float32  # what PPO receives
    assert np.flatnonzero(dense).tolist() == [4, 16, 28]
    assert dense[[4, 16, 28]].tolist() == [float(np.float32(v)) for v in trace["values"]]
    assert trajectory_invariants(record, breakdown, trace, dense) == ZERO
    with pytest.raises(ValueError, match="outside the response"):
        token_level_rewards(trace, 28)
    with pytest.raises(ValueError, match="repeated offsets"):
        token_level_rewards({"offsets": [1, 1], "values": [0.5, 0.5]}, 10)
    with pytest.raises(ValueError, match="float32 array PPO receives"):
        trajectory_invariants(record, breakdown, trace, dense.astype(np.float64))


def test_float32_rounding_of_final_reward_is_not_a_mapping_error(build):
    # -0.1 * 0.12 is not a float32: the array's exact sum differs from the float64 final_reward,
    # by the rounding of the pieces alone, and the invariant (taken against the float32 pieces) is 0.
    record, breakdown, trace = _scored(build)
    dense = token_level_rewards(trace, 29)
    float32_sum = math.fsum(dense.astype(np.float64).tolist())
    assert float32_sum != breakdown["final_reward"]
    assert abs(float32_sum - breakdown["final_reward"]) <= 3 * np.finfo(np.float32).eps / 2
    assert trajectory_invariants(record, breakdown, trace, dense)["mapping_sum_error"] == 0.0


def test_one_token_reward_dropped_or_altered_after_placement_moves_both_invariants(build):
    record, breakdown, trace = _scored(build)
    lost = token_level_rewards(trace, 29)
    lost[16] = 0.0  # the second explore's reward lost between placement and PPO
    result = trajectory_invariants(record, breakdown, trace, lost)
    assert result["mapped_slots_minus_events"] == -1
    assert result["mapping_sum_error"] == pytest.approx(0.1 * 0.5, rel=1e-6)

    altered = token_level_rewards(trace, 29)
    altered[4] = np.float32(-0.5)  # a value changed in place: the sum moves, the slot count cannot
    result = trajectory_invariants(record, breakdown, trace, altered)
    assert result["mapped_slots_minus_events"] == 0
    assert result["mapping_sum_error"] == pytest.approx(0.5 - 0.1 * 0.12, rel=1e-6)

    terminal = token_level_rewards(trace, 29)
    terminal[28] = np.float32(0.0)  # the terminal reward (1.0) dropped
    result = trajectory_invariants(record, breakdown, trace, terminal)
    assert result == {"mapping_sum_error": pytest.approx(1.0, rel=1e-6), "mapped_slots_minus_events": -1}

    stray = token_level_rewards(trace, 29)
    stray[10] = np.float32(0.3)  # a stray value, e.g. a reward mis-sliced onto a tool-response token
    result = trajectory_invariants(record, breakdown, trace, stray)
    assert result["mapped_slots_minus_events"] == 1 and result["mapping_sum_error"] == pytest.approx(0.3, rel=1e-6)

    merged = token_level_rewards(trace, 29)
    merged[16] += merged[4]
    merged[4] = 0.0  # the sum is kept (to float32 rounding), one slot lost
    result = trajectory_invariants(record, breakdown, trace, merged)
    assert result["mapped_slots_minus_events"] == -1 and result["mapping_sum_error"] < 1e-8


def test_zero_valued_events_are_counted_on_neither_side(build):
    # A $0.00 candidate then a wrong submit: two events of value 0, nothing non-zero to place.
    question = build.question(costs=(0.0, 0.1, 0.1, 0.1), permutations=[(0, 1, 2, 3)])
    episode = Episode(question, 0)
    build.run(episode, [build.call("explore"), build.call("submit", {"answer": "A"})])
    record = episode.to_record_episode()
    breakdown = reward_breakdown(record, 0.1)
    trace = place_rewards(record, breakdown)
    dense = token_level_rewards(trace, 17)
    assert not dense.any() and trajectory_invariants(record, breakdown, trace, dense) == ZERO
    stray = dense.copy()
    stray[10] = np.float32(1.0)  # a reward off every event
    assert trajectory_invariants(record, breakdown, trace, stray) == {"mapping_sum_error": 1.0,
                                                                      "mapped_slots_minus_events": 1}
    on_event = dense.copy()
    on_event[16] = np.float32(1.0)  # on the wrong submit's own token: a slot it already is; the sum tells
    assert trajectory_invariants(record, breakdown, trace, on_event) == {"mapping_sum_error": 1.0,
                                                                         "mapped_slots_minus_events": 0}
    # a trace that leaves the zero-valued explore out (a scorer forgetting an event): one slot short
    partial = {"offsets": [16], "values": [0.0]}
    assert trajectory_invariants(record, breakdown, partial, token_level_rewards(partial, 17)) == {
        "mapping_sum_error": 0.0, "mapped_slots_minus_events": -1}


def test_batch_aggregation_keeps_the_sign_of_the_largest():
    rows = [{"mapping_sum_error": 0.0, "mapped_slots_minus_events": 0},
            {"mapping_sum_error": 0.25, "mapped_slots_minus_events": -2},
            {"mapping_sum_error": 0.1, "mapped_slots_minus_events": 1}]
    assert batch_invariants(rows) == {"reward/mapping_sum_error_max": 0.25, "reward/mapped_slots_minus_events_max": -2}
    assert batch_invariants([]) == {"reward/mapping_sum_error_max": 0.0, "reward/mapped_slots_minus_events_max": 0}
