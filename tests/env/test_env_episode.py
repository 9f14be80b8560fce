"""The runtime's protocol, quota, terminal reasons, permutations, rendering and event log."""

import dataclasses
import hashlib
import json

import pytest

from atlas_lightning.env import Episode, RuntimeConfig, TERMINAL_REASON_CODES, tool_schemas
from atlas_lightning.env.permutation import candidate_fingerprint, derived_permutation
from atlas_lightning.env.render import format_usd


def test_terminal_codes_are_stable():
    # Part of the on-disk contract: a change here breaks every earlier record.
    assert TERMINAL_REASON_CODES == {"submitted": 0, "no_tool_call": 1, "malformed_call": 2, "max_turns": 3,
                                     "response_length": 4, "context_overflow": 5}


@pytest.mark.parametrize("amount, text", [(0.12, "$0.12"), (1.5, "$1.50"), (0.012, "$0.012"), (0.0035, "$0.0035"),
                                          (0.0, "$0.00"), (0.001, "$0.0010"), (12.0, "$12.00")])
def test_format_usd(amount, text):
    assert format_usd(amount) == text


def test_messages_and_tools(build):
    episode = Episode(build.question("lcb"), 0)
    system, user = episode.messages()
    assert system["role"] == "system" and user["role"] == "user"
    assert "explore" in system["content"] and "submit" in system["content"] and "At most 4 explores" in system["content"]
    assert "You have up to 4 explores." in user["content"] and '"#k"' in user["content"]
    assert "What is it?" in user["content"]
    assert len(system["content"].split()) < 250
    names = [t["function"]["name"] for t in episode.tools()]
    assert names == ["explore", "submit"]
    assert episode.tools()[1]["function"]["parameters"]["required"] == ["answer"]
    json.dumps(tool_schemas("gpqa"))  # JSON-serialisable for the chat template
    gpqa_user = Episode(build.question("gpqa"), 0).messages()[1]["content"]
    assert "letter" in gpqa_user and "You have up to 4 explores." in gpqa_user


def test_explore_reveals_in_permutation_order_and_renders(build):
    question = build.question(costs=(0.12, 0.5, 0.003, 0.0), permutations=[(2, 0, 3, 1)])
    episode = Episode(question, 0)
    first = episode.on_assistant_turn(build.call("explore"), 0, 4)
    assert first == ("Candidate #1\nAnswer: C\nApproach: approach 2\nConfidence: 0.60\nCost: $0.0030\n"
                     "Explore budget: 1/4 used, 3 remaining.")
    episode.on_tool_response_tokens(4, 10)
    second = episode.on_assistant_turn(build.call("explore"), 10, 12)
    assert second.startswith("Candidate #2\nAnswer: A\n") and "Cost: $0.12\n" in second
    assert second.endswith("Explore budget: 2/4 used, 2 remaining.")
    explores = [e for e in episode.events if e["type"] == "explore"]
    assert [(e["explore_k"], e["candidate_idx"], e["charged_cost_usd"], e["offsets"]) for e in explores] == [
        (1, 2, 0.003, [0, 4]), (2, 0, 0.12, [10, 12])]
    assert explores[0]["tool_response_offsets"] == [4, 10] and explores[1]["tool_response_offsets"] is None


def test_lcb_response_shows_code(build):
    episode = Episode(build.question("lcb"), 0)
    reply = episode.on_assistant_turn(build.call("explore"), 0, 3)
    assert reply.startswith("Candidate #1\nCode:\n```python\ndef solve():\n    return 0\n```\nApproach: approach 0")


def test_quota_then_over_quota_is_free_and_not_terminal(build):
    question = build.question(costs=(0.1, 0.2, 0.3), correct=(True, False, False), permutations=[(0, 1, 2)])
    episode = Episode(question, 0, RuntimeConfig(max_explores=2, max_turns=9))
    replies = build.run(episode, [build.call("explore")] * 4)
    assert all(r is not None for r in replies) and not episode.done
    assert replies[1].endswith("Explore budget: 2/2 used, 0 remaining.")
    assert replies[2] == replies[3] and "quota spent" in replies[2] and "nothing was charged" in replies[2]
    assert replies[2].endswith("Explore budget: 2/2 used, 0 remaining.")
    kinds = [e["type"] for e in episode.events]
    assert kinds == ["explore", "explore", "explore_over_quota", "explore_over_quota"]
    assert [e["charged_cost_usd"] for e in episode.events] == [0.1, 0.2, 0.0, 0.0]


def test_quota_is_capped_by_the_number_of_candidates(build):
    episode = Episode(build.question(costs=(0.1, 0.2), correct=(True, False), permutations=[(1, 0)]), 0)
    assert episode.explore_quota == 2
    replies = build.run(episode, [build.call("explore")] * 3)
    assert "quota spent" in replies[2]


def test_submit_ends_and_grades(build):
    episode = Episode(build.question(), 0)
    replies = build.run(episode, [build.call("explore"), build.call("submit", {"answer": "The answer is B"})])
    assert replies[-1] is None and episode.done and episode.terminal_reason == "submitted"
    submit = episode.events[-2]
    assert submit["type"] == "submit" and submit["payload"] == {"answer": "The answer is B"} and submit["acc"] == 1
    assert episode.events[-1] == {"type": "terminal", "turn": 2, "terminal_reason": "submitted",
                                  "terminal_reason_code": 0, "last_generated": 16}


@pytest.mark.parametrize("text, reason", [("I give up.", "no_tool_call"),
                                          ('<tool_call>{"name": "explore"</tool_call>', "malformed_call")])
def test_no_call_and_malformed_are_terminal(build, text, reason):
    episode = Episode(build.question(), 0)
    assert build.run(episode, [build.call("explore"), text])[-1] is None
    assert episode.terminal_reason == reason and episode.events[-1]["last_generated"] == 16


def test_max_turns_charges_the_last_turn_explore(build):
    question = build.question(costs=(0.1, 0.2, 0.3, 0.4), correct=(False,) * 4)
    episode = Episode(question, 0, RuntimeConfig(max_explores=8, max_turns=3))
    replies = build.run(episode, [build.call("explore")] * 3)
    assert replies[:2] != [None, None] and replies[2] is None
    assert episode.terminal_reason == "max_turns"
    last_explore = episode.events[-2]
    assert last_explore["explore_k"] == 3 and last_explore["charged_cost_usd"] == 0.3
    assert last_explore["tool_response_offsets"] is None
    assert episode.events[-1]["last_generated"] == last_explore["offsets"][1] - 1


def test_several_calls_execute_the_first_and_say_so(build):
    episode = Episode(build.question(), 0)
    reply = episode.on_assistant_turn(build.call("explore") + build.call("submit", {"answer": "B"}), 0, 9)
    assert reply.startswith("Note: one tool call per turn; 1 further call was ignored.\nCandidate #1")
    assert not episode.done
    assert [c["status"] for c in episode.proposed_calls] == ["executed", "ignored"]


def test_stop_response_length_after_an_explore_that_did_not_fit(build):
    episode = Episode(build.question(), 0)
    assert episode.on_assistant_turn(build.call("explore"), 0, 6) is not None
    episode.stop("response_length")
    assert episode.terminal_reason == "response_length" and episode.events[-1]["last_generated"] == 5
    record = episode.to_record_episode()
    assert record["terminal_reason_code"] == 4 and record["token_counts"]["response"] == 6


def test_stop_with_a_truncated_turn(build):
    episode = Episode(build.question(), 0)
    build.run(episode, [build.call("explore")])
    episode.stop("response_length", last_generated=30, text='<tool_call>{"name": "sub', start=12)
    assert episode.generations[-1]["truncated"] is True and episode.generations[-1]["offsets"] == [12, 31]
    assert episode.events[-1]["last_generated"] == 30 and episode.num_turns == 2
    assert [e["type"] for e in episode.events] == ["explore", "terminal"]


def test_context_overflow_before_any_token(build):
    episode = Episode(build.question(), 0)
    episode.stop("context_overflow")
    assert episode.events == [{"type": "terminal", "turn": 0, "terminal_reason": "context_overflow",
                               "terminal_reason_code": 5, "last_generated": None}]


def test_protocol_misuse_is_refused_clearly(build):
    episode = Episode(build.question(), 0)
    with pytest.raises(ValueError, match="empty or reversed"):
        episode.on_assistant_turn("x", 3, 3)
    with pytest.raises(ValueError, match="ints >= 0"):
        episode.on_assistant_turn("x", -1, 3)
    with pytest.raises(TypeError, match="decoded str"):
        episode.on_assistant_turn(b"x", 0, 3)
    with pytest.raises(RuntimeError, match="no tool response is pending"):
        episode.on_tool_response_tokens(0, 3)
    with pytest.raises(RuntimeError, match="not ended"):
        episode.to_record_episode()
    episode.on_assistant_turn(build.call("explore"), 0, 5)
    with pytest.raises(RuntimeError, match="on_tool_response_tokens"):
        episode.on_assistant_turn(build.call("explore"), 10, 12)
    with pytest.raises(ValueError, match="starts before"):
        episode.on_tool_response_tokens(4, 8)
    episode.on_tool_response_tokens(5, 9)
    with pytest.raises(ValueError, match="starts before"):
        episode.on_assistant_turn(build.call("explore"), 8, 12)
    with pytest.raises(ValueError, match="reason must be one of"):
        episode.stop("submitted")
    with pytest.raises(ValueError, match="last_generated"):
        episode.stop("response_length", last_generated=6)  # inside the tool response
    episode.stop("response_length", last_generated=9)
    with pytest.raises(RuntimeError, match="already ended"):
        episode.on_assistant_turn("x", 20, 21)
    with pytest.raises(RuntimeError, match="already ended"):
        episode.stop("response_length")


def test_bad_questions_and_configs_are_refused(build):
    with pytest.raises(ValueError, match="not a choice letter"):
        Episode(build.question(ground_truth="42"), 0)
    with pytest.raises(ValueError, match=r"candidates\[1\].cost_usd"):
        Episode(build.question(costs=(0.1, float("nan"), 0.1, 0.1)), 0)
    with pytest.raises(ValueError, match=r"candidates\[0\].confidence"):
        Episode(dataclasses.replace(build.question(), candidates=(
            dataclasses.replace(build.question().candidates[0], confidence=None),)), 0)
    with pytest.raises(ValueError, match="not a permutation"):
        Episode(build.question(permutations=[(0, 1, 1, 3)]), 0)
    with pytest.raises(ValueError, match="benchmark"):
        Episode(build.question(benchmark="mmlu"), 0)
    with pytest.raises(ValueError, match="max_turns"):
        RuntimeConfig(max_turns=0)


def test_given_permutations_cycle_by_sample_index(build):
    question = build.question(permutations=[(0, 1, 2, 3), (3, 2, 1, 0)])
    episodes = [Episode(question, i) for i in range(3)]
    assert [e.permutation_id for e in episodes] == [0, 1, 0]
    assert episodes[1].permutation == (3, 2, 1, 0)
    assert episodes[0].candidate_fingerprint == episodes[2].candidate_fingerprint != episodes[1].candidate_fingerprint


def _reference_shuffle(n, seed, question_id, sample_index):
    """The documented derivation written out again: Fisher-Yates, j = sha256(key, i)[:8] mod (i+1)."""
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        digest = hashlib.sha256(f"{seed}\x1f{question_id}\x1f{sample_index}\x1f{i}".encode()).digest()
        j = int.from_bytes(digest[:8], "big") % (i + 1)
        order[i], order[j] = order[j], order[i]
    return tuple(order)


def test_derived_permutation_is_stable(build):
    # Pinned values: the derivation must not change across versions or processes.
    assert derived_permutation(8, 0, "gpqa-0001", 0) == (3, 2, 7, 5, 4, 6, 1, 0)
    for args in [(8, 0, "gpqa-0001", 0), (5, 11, "lcb-9", 31), (1, 0, "x", 0)]:
        assert derived_permutation(*args) == _reference_shuffle(*args)
    assert derived_permutation(8, 0, "gpqa-0001", 1) != derived_permutation(8, 0, "gpqa-0001", 0)
    assert derived_permutation(8, 1, "gpqa-0001", 0) != derived_permutation(8, 0, "gpqa-0001", 0)
    assert sorted(derived_permutation(50, 3, "x", 9)) == list(range(50))
    question = build.question(permutations=())
    episode = Episode(question, 5, seed=7)
    assert episode.permutation_id == -1 and episode.permutation == derived_permutation(4, 7, "q-1", 5)


def test_candidate_fingerprint_against_an_independent_hash(build):
    question = build.question(permutations=[(1, 0, 2, 3)])
    ids = [[c.solver_model, c.cost_usd, c.answer] for c in (question.candidates[i] for i in (1, 0, 2, 3))]
    expected = hashlib.sha1(json.dumps(ids, separators=(",", ":")).encode()).hexdigest()[:16]
    assert candidate_fingerprint(question.candidates, (1, 0, 2, 3)) == expected
    assert Episode(question, 0).candidate_fingerprint == expected


def test_record_episode_is_json_and_complete(build):
    episode = Episode(build.question(), 0)
    episode.on_prompt_tokens(120)
    build.run(episode, [build.call("explore"), "bare text"])
    record = json.loads(json.dumps(episode.to_record_episode()))
    assert record["terminal_reason"] == "no_tool_call" and record["num_turns"] == 2
    assert record["token_counts"] == {"prompt": 120, "response": 17, "generated": 10, "tool_response": 7}
    assert {"generations", "proposed_calls", "events", "permutation_id", "candidate_fingerprint"} <= set(record)
