"""Placement of reward pieces on response tokens, and the two invariants."""

import copy
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
    assert shaped["invariants"] == {"mapping_sum_error": 0.5, "mapped_slots_minus_events": 0}


def _scored(build):
    episode = Episode(build.question(), 0)
    build.run(episode, [build.call("explore"), build.call("explore"), build.call("submit", {"answer": "B"})])
    record = episode.to_record_episode()
    breakdown = reward_breakdown(record, 0.1)
    return record, breakdown, place_rewards(record, breakdown)


def test_dense_rewards(build):
    record, breakdown, trace = _scored(build)
    dense = token_level_rewards(trace, 29)
    assert dense.shape == (29,) and dense.dtype == np.float64
    assert np.flatnonzero(dense).tolist() == [4, 16, 28]
    assert trajectory_invariants(record, breakdown, trace, dense) == ZERO
    with pytest.raises(ValueError, match="outside the response"):
        token_level_rewards(trace, 28)
    with pytest.raises(ValueError, match="repeated offsets"):
        token_level_rewards({"offsets": [1, 1], "values": [0.5, 0.5]}, 10)


def test_invariants_catch_dropped_stray_and_merged_rewards(build):
    record, breakdown, trace = _scored(build)
    dropped = copy.deepcopy(trace)
    del dropped["offsets"][0], dropped["values"][0]
    assert trajectory_invariants(record, breakdown, dropped) == {
        "mapping_sum_error": pytest.approx(0.1 * 0.12, abs=1e-15), "mapped_slots_minus_events": -1}
    dense = token_level_rewards(trace, 29)
    dense[10] = 0.3  # a stray value, e.g. a reward mis-sliced onto a tool-response token
    assert trajectory_invariants(record, breakdown, trace, dense)["mapped_slots_minus_events"] == 1
    merged = token_level_rewards(trace, 29)
    merged[16] += merged[4]
    merged[4] = 0.0  # the sum is kept, one slot lost
    result = trajectory_invariants(record, breakdown, {"offsets": [], "values": []}, merged)
    assert result["mapped_slots_minus_events"] == -1 and result["mapping_sum_error"] < 1e-15


def test_batch_aggregation_keeps_the_sign_of_the_largest():
    rows = [{"mapping_sum_error": 0.0, "mapped_slots_minus_events": 0},
            {"mapping_sum_error": 0.25, "mapped_slots_minus_events": -2},
            {"mapping_sum_error": 0.1, "mapped_slots_minus_events": 1}]
    assert batch_invariants(rows) == {"reward/mapping_sum_error_max": 0.25, "reward/mapped_slots_minus_events_max": -2}
    assert batch_invariants([]) == {"reward/mapping_sum_error_max": 0.0, "reward/mapped_slots_minus_events_max": 0}
