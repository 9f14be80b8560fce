"""Property tests: for any sequence of turns the invariants are exactly 0 and the breakdown matches
an independent simulation of the rules (README, "An episode" and "The reward")."""

import json
import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atlas_lightning.questions.schema import Candidate, Question
from atlas_lightning.env import Episode, RuntimeConfig
from atlas_lightning.reward import score_episode, token_level_rewards, trajectory_invariants

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

EXPLORE = '<tool_call>{"name": "explore", "arguments": {}}</tool_call>'


def submit(answer):
    return "<tool_call>" + json.dumps({"name": "submit", "arguments": {"answer": answer}}) + "</tool_call>"


# (text, what it names): GPQA -> the letter read, LCB -> the k named; None names nothing.
GPQA_ANSWERS = [("B", "B"), ("The answer is C", "C"), ("(A)", "A"), ("d", "D"), ("A or B", None), ("", None)]
LCB_ANSWERS = [("#1", 1), ("#2", 2), ("#3", 3), ("#0", 0), ("candidate #2", 2), ("print(1)", None), ("", None)]
MALFORMED = ['<tool_call>{"name": "explore"', "</tool_call>", '<tool_call>{"name": "x"}</tool_call>',
             '<tool_call>{"name": "submit", "arguments": {"answer": 1}}</tool_call>']


@st.composite
def questions(draw):
    benchmark = draw(st.sampled_from(["gpqa", "lcb"]))
    n = draw(st.integers(1, 10))
    costs = draw(st.lists(st.one_of(st.just(0.0), st.floats(0, 3, allow_nan=False)), min_size=n, max_size=n))
    correct = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    permutations = draw(st.lists(st.permutations(range(n)), max_size=3))
    candidates = tuple(Candidate(answer=f"print({i + 10})", approach="a", confidence=0.5, cost_usd=c,
                                 is_correct=ok, solver_model=f"m{i}") for i, (c, ok) in enumerate(zip(costs, correct)))
    return Question(question_id=f"q{draw(st.integers(0, 99))}", benchmark=benchmark, problem="p",
                    ground_truth=draw(st.sampled_from("ABCD")), candidates=candidates,
                    permutations=tuple(tuple(p) for p in permutations))


turn = st.one_of(
    st.just(("explore", EXPLORE, None)),
    st.just(("explore", EXPLORE + " and also " + submit("B"), None)),  # a second call is ignored
    st.integers(0, 100).map(lambda i: ("submit", i, None)),
    st.text(st.characters(blacklist_characters="<"), max_size=30).map(lambda t: ("text", t, None)),
    st.sampled_from(MALFORMED).map(lambda t: ("malformed", t, None)),
)


def simulate(question, config, turns, permutation):
    """The rules written out independently: returns (charged costs, acc, submitted)."""
    quota = min(config.max_explores, len(question.candidates))
    revealed, acc, submitted = [], 0, False
    for number, (kind, payload, named) in enumerate(turns, start=1):
        if kind == "explore":
            if len(revealed) < quota:
                revealed.append(len(revealed))
        elif kind == "submit":
            submitted = True
            if question.benchmark == "gpqa":
                acc = int(named == question.ground_truth)
            else:
                acc = int(isinstance(named, int) and 1 <= named <= len(revealed)
                          and question.candidates[permutation[named - 1]].is_correct)
            break
        else:
            break
        if number >= config.max_turns:
            break
    costs = [question.candidates[permutation[i]].cost_usd for i in revealed]
    return costs, acc, submitted


@SETTINGS
@given(question=questions(), max_explores=st.integers(0, 10), max_turns=st.integers(1, 12),
       raw_turns=st.lists(turn, min_size=1, max_size=14), lengths=st.lists(st.integers(1, 30), min_size=30, max_size=30),
       gap=st.integers(0, 3), ending=st.sampled_from(["response_length", "context_overflow", "truncated"]),
       drop_last_response=st.booleans(), lam=st.sampled_from([0.1, 0.0, 1.7]), shaping=st.sampled_from([0.0, -0.5]),
       sample_index=st.integers(0, 64))
def test_invariants_and_breakdown_for_any_turn_sequence(question, max_explores, max_turns, raw_turns, lengths, gap,
                                                        ending, drop_last_response, lam, shaping, sample_index):
    answers = GPQA_ANSWERS if question.benchmark == "gpqa" else LCB_ANSWERS
    turns = []
    for kind, payload, _ in raw_turns:
        if kind == "submit":
            answer, named = answers[payload % len(answers)]
            turns.append((kind, submit(answer), named))
        else:
            turns.append((kind, payload, None))
    config = RuntimeConfig(max_explores=max_explores, max_turns=max_turns)
    episode = Episode(question, sample_index, config, seed=3)

    cursor, size = 0, iter(lengths)
    for index, (_, text, _) in enumerate(turns):
        start = cursor + gap
        end = start + next(size)
        reply = episode.on_assistant_turn(text, start, end)
        cursor = end
        if reply is None:
            break
        if drop_last_response and index == len(turns) - 1:
            break
        response_end = end + next(size)
        episode.on_tool_response_tokens(end, response_end)
        cursor = response_end
    if not episode.done:
        if ending == "truncated":
            last = cursor + gap + next(size)
            episode.stop("response_length", last_generated=last, text="<tool_call>{", start=cursor + gap)
            cursor = last + 1
        else:
            episode.stop(ending)

    record = json.loads(json.dumps(episode.to_record_episode()))  # as read back from disk
    scored = score_episode(record, lam, shaping)
    reward, trace = scored["reward"], scored["reward_trace"]

    assert scored["invariants"] == {"mapping_sum_error": 0.0, "mapped_slots_minus_events": 0}
    dense = token_level_rewards(trace, cursor)
    assert trajectory_invariants(record, reward, trace, dense) == {"mapping_sum_error": 0.0, "mapped_slots_minus_events": 0}
    assert math.fsum(trace["values"]) == reward["final_reward"]
    # float32, what PPO receives: the final reward to the rounding of its pieces
    assert abs(math.fsum(dense.astype(np.float64).tolist()) - reward["final_reward"]) <= \
        len(trace["values"]) * np.finfo(np.float32).eps * max([1.0] + [abs(v) for v in trace["values"]])

    costs, acc, submitted = simulate(question, config, turns, episode.permutation)
    assert reward["acc"] == acc and reward["submitted"] == int(submitted)
    assert reward["num_explores"] == len(costs)
    assert [reward[f"explore_reward_{k}"] for k in range(1, len(costs) + 1)] == [-(lam * c) + 0.0 for c in costs]
    assert all(reward[f"explore_reward_{k}"] == 0.0 for k in range(len(costs) + 1, 9))
    assert reward["cost_total"] == math.fsum(costs) and reward["cost"] == lam * math.fsum(costs)
    expected_terminal = acc + (0.0 if submitted else shaping)
    assert reward["terminal_reward"] == expected_terminal
    assert math.isclose(reward["final_reward"], expected_terminal - lam * math.fsum(costs), rel_tol=1e-12, abs_tol=1e-12)
    assert reward["objective"] == acc - lam * math.fsum(costs)
    correct_ks = [k for k in range(1, len(costs) + 1) if question.candidates[episode.permutation[k - 1]].is_correct]
    assert reward["first_correct_k"] == (correct_ks[0] if correct_ks else 0)
    assert reward["submitted_after_correct"] == int(submitted and bool(correct_ks))
    # Reward lands only on generated tokens, never inside a tool response.
    for generation in record["generations"]:
        span = generation["tool_response_offsets"]
        if span:
            assert not any(span[0] <= o < span[1] for o in trace["offsets"])


FRAGMENTS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>",
             '{"name": "submit", "arguments": {"answer": "B"}}', '{"name": "explore"}', '{"name": "explore", ',
             "Candidate #1", "Cost: $0.00", "Explore budget: 0/8 used, 8 remaining.", '"', "{", "}", "<|im_end|>",
             "\ud800", "\ufffd", "B"]


@SETTINGS
@given(turns=st.lists(st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=8)), max_size=12).map("".join),
                      min_size=1, max_size=10))
def test_fragment_soup_never_crashes_or_cheats(build, turns):
    question = build.question(ground_truth="B", costs=(0.1, 0.2, 0.3, 0.4))
    episode = Episode(question, 0)
    build.run(episode, turns)
    if not episode.done:
        episode.stop("response_length")
    record = episode.to_record_episode()
    scored = score_episode(record, 0.1)
    assert scored["invariants"] == {"mapping_sum_error": 0.0, "mapped_slots_minus_events": 0}
    reward = scored["reward"]
    if reward["acc"]:
        submit_event = record["events"][-2]
        assert submit_event["type"] == "submit" and submit_event["grading"]["letter"] == "B"
    explores = [e for e in record["events"] if e["type"] == "explore"]
    assert reward["cost_total"] == math.fsum(question.candidates[e["candidate_idx"]].cost_usd for e in explores)
