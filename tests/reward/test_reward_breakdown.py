"""Exact reward arithmetic on hand-built episodes (README, "The reward")."""

import copy

import pytest

from atlas_lightning.env import Episode, RuntimeConfig
from atlas_lightning.reward import reward_breakdown, reward_means, score_episode


def _episode(build, turns, question=None, config=None):
    episode = Episode(question or build.question(), 0, config)
    build.run(episode, turns)
    if not episode.done:
        episode.stop("response_length")
    return episode.to_record_episode()


def test_two_explores_then_a_correct_submit(build):
    # Order (0, 1, 2, 3): reveals $0.12 (wrong) then $0.50 (right), submits B (= ground truth).
    record = _episode(build, [build.call("explore"), build.call("explore"), build.call("submit", {"answer": "B"})])
    r = reward_breakdown(record, cost_per_usd=0.1)
    assert r["acc"] == 1
    assert r["cost_total"] == 0.62
    assert r["cost"] == 0.1 * 0.62
    assert r["explore_reward_1"] == -(0.1 * 0.12) and r["explore_reward_2"] == -(0.1 * 0.5)
    assert [r[f"explore_reward_{k}"] for k in range(3, 9)] == [0.0] * 6
    assert r["terminal_reward"] == 1.0
    assert r["final_reward"] == pytest.approx(1 - 0.012 - 0.05, abs=1e-15)
    assert r["objective"] == pytest.approx(0.938, abs=1e-15)
    assert r["training_reward"] == r["final_reward"]
    assert (r["found_correct"], r["first_correct_k"], r["submitted_after_correct"]) == (1, 2, 1)
    assert (r["terminal_reason_code"], r["submitted"], r["num_explores"], r["num_turns"]) == (0, 1, 2, 3)


def test_wrong_submit_before_seeing_the_correct_one(build):
    record = _episode(build, [build.call("explore"), build.call("submit", {"answer": "A"})])
    r = reward_breakdown(record, cost_per_usd=0.1)
    assert (r["acc"], r["found_correct"], r["first_correct_k"], r["submitted_after_correct"]) == (0, 0, 0, 0)
    assert r["final_reward"] == -(0.1 * 0.12) == r["objective"]


def test_cost_is_in_dollars_times_lambda(build):
    record = _episode(build, [build.call("explore")] * 4 + [build.call("submit", {"answer": "B"})])
    r = reward_breakdown(record, cost_per_usd=2.0)
    assert r["cost_total"] == pytest.approx(0.12 + 0.5 + 0.003 + 0.0, abs=1e-15)
    assert r["explore_reward_4"] == 0.0  # a $0.00 candidate costs nothing, and is not -0.0
    assert str(r["explore_reward_4"]) == "0.0"
    assert r["final_reward"] == pytest.approx(1 - 2.0 * 0.623, abs=1e-14)


def test_no_submit_shaping_enters_final_but_not_objective(build):
    record = _episode(build, [build.call("explore"), "no call"])
    plain = reward_breakdown(record, cost_per_usd=0.1)
    shaped = reward_breakdown(record, cost_per_usd=0.1, no_submit_reward=-0.5)
    assert plain["terminal_reward"] == 0.0 and shaped["terminal_reward"] == -0.5
    assert shaped["final_reward"] == pytest.approx(-0.5 - 0.012, abs=1e-15) == shaped["training_reward"]
    assert shaped["objective"] == plain["objective"] == -(0.1 * 0.12)
    assert shaped["terminal_reason_code"] == 1 and shaped["submitted"] == 0
    # Shaping never applies to a submitted episode.
    submitted = _episode(build, [build.call("submit", {"answer": "A"})])
    assert reward_breakdown(submitted, 0.1, no_submit_reward=-0.5)["terminal_reward"] == 0.0


def test_more_explore_fields_when_the_quota_is_larger(build):
    question = build.question(costs=(0.01,) * 10, correct=(False,) * 10, permutations=[tuple(range(10))])
    record = _episode(build, [build.call("explore")] * 10, question, RuntimeConfig(max_explores=10, max_turns=12))
    r = reward_breakdown(record, 0.1)
    assert r["explore_reward_10"] == -(0.1 * 0.01) and r["num_explores"] == 10


def test_scores_and_means(build):
    a = score_episode(_episode(build, [build.call("submit", {"answer": "B"})]), 0.1)["reward"]
    b = score_episode(_episode(build, ["nothing"]), 0.1)["reward"]
    means = reward_means([a, b])
    assert means["reward/acc"] == 0.5 and means["reward/terminal_reason_code"] == 0.5


def test_bad_inputs_are_refused(build):
    record = _episode(build, [build.call("explore"), build.call("explore"), build.call("submit", {"answer": "B"})])
    with pytest.raises(ValueError, match="cost_per_usd"):
        reward_breakdown(record, -0.1)
    with pytest.raises(ValueError, match="no_submit_reward"):
        reward_breakdown(record, 0.1, float("nan"))

    def broken(mutate):
        bad = copy.deepcopy(record)
        mutate(bad)
        return bad

    cases = [
        (lambda r: r["events"][1].update(explore_k=3), r"events\[1\]: explore_k=3, expected 2"),
        (lambda r: r["events"][0].update(charged_cost_usd=-1.0), r"events\[0\]: charged_cost_usd"),
        (lambda r: r["events"][0].update(charged_cost_usd=float("inf")), r"events\[0\]: charged_cost_usd"),
        (lambda r: r["events"][0].update(offsets=[5, 5]), r"events\[0\]: offsets"),
        (lambda r: r["events"][0].update(is_correct=1), r"events\[0\]: is_correct"),
        (lambda r: r["events"].append(r["events"][0]), "terminal event must be the last"),
        (lambda r: r["events"][2].update(acc=2), "acc must be 0 or 1"),
        (lambda r: r["events"][3].update(terminal_reason="max_turns"), "terminal reason"),
        (lambda r: r["events"][3].update(terminal_reason_code=7), "does not match"),
        (lambda r: r["events"].pop(2), "disagrees with the presence of a submit"),
        (lambda r: r["events"][0].update(type="reveal_all"), "type 'reveal_all'"),
        (lambda r: r.update(events=[]), "non-empty list"),
        (lambda r: r["events"][3].update(last_generated=None), "last_generated is null"),
        (lambda r: r.update(max_explores=1), "exceed max_explores"),
    ]
    for mutate, message in cases:
        with pytest.raises(ValueError, match=message):
            reward_breakdown(broken(mutate), 0.1)
