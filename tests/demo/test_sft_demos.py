"""Scripted demonstrations: exactly the tokens the agent loop records, varied, and not optimal."""

from __future__ import annotations

import random
import statistics
from collections import Counter

import pytest

from atlas_lightning.demo.demos import (
    EXPLORE_TURN,
    SUBMIT_STRATEGIES,
    Demo,
    DoesNotFit,
    build_demos,
    choose_answer,
    render_demo,
    submit_turn,
)
from atlas_lightning.questions.schema import Candidate, Question
from atlas_lightning.demo.tiny_orchestrator import TINY_CPU_LIMITS, TINY_CPU_RUNTIME
from atlas_lightning.env.grading import RevealedCandidate
from atlas_lightning.env.parsing import CALL, parse_turn
from atlas_lightning.config import LoopLimits
from atlas_lightning.rollout.agent_loop import AgentLoop, Sampling, Trajectory
from atlas_lightning.rollout.engine import Engine, GenerationRequest, GenerationResult


class ReplayEngine(Engine):
    """Generates each demonstration's scripted turns, in order, as a model would: it stops at
    ``max_tokens`` like a real engine (``length``), and records every prompt it was sent."""

    name = "replay"

    def __init__(self, demos: dict[str, Demo]) -> None:
        self.turns = {uid: _turns(demo) for uid, demo in demos.items()}
        self.sent: dict[str, list[tuple[int, ...]]] = {uid: [] for uid in demos}
        self.queue: list[GenerationRequest] = []

    def submit(self, request: GenerationRequest) -> None:
        self.queue.append(request)

    def poll(self) -> list[GenerationResult]:
        results = []
        for request in self.queue:
            uid, _, turn, _ = request.request_id.split("/")
            self.sent[uid].append(request.prompt_ids)
            tokens = self.turns[uid][int(turn[1:])]
            limit = request.sampling.max_tokens
            reason = "stop" if len(tokens) <= limit else "length"
            kept = tokens[:limit]
            results.append(GenerationResult(request.request_id, kept, [0.0] * len(kept), reason))
        self.queue = []
        return results

    def num_pending(self) -> int:
        return len(self.queue)

    def prompt_logprobs(self, token_ids):
        raise NotImplementedError


def _turns(demo: Demo) -> list[list[int]]:
    """The demonstration's generated turns: the runs of loss-mask 1 in its response."""
    turns, current = [], []
    for token, trained in zip(demo.response_ids, demo.response_mask):
        if trained:
            current.append(token)
        elif current:
            turns.append(current)
            current = []
    return turns + ([current] if current else [])


def _replay(demos: list[Demo], questions: dict[str, Question], chat, limits: LoopLimits) -> list[Trajectory]:
    from atlas_lightning.env.episode import Episode

    by_uid = {f"{d.question_id}-{d.sample_index}": d for d in demos}
    trajectories = []
    for uid, demo in by_uid.items():
        episode = Episode(questions[demo.question_id], demo.sample_index, TINY_CPU_RUNTIME)
        prompt = chat.prompt_ids(episode.messages(), episode.tools())
        trajectories.append(Trajectory(uid=uid, session_id="n000", episode=episode, prompt_ids=prompt))
    engine = ReplayEngine(by_uid)
    AgentLoop(engine, chat, limits).run(trajectories, Sampling(temperature=0.0))
    for traj in trajectories:  # the loop sent exactly the demonstration's prefix before each turn
        demo = by_uid[traj.uid]
        assert all(demo.input_ids[: len(sent)] == sent for sent in engine.sent[traj.uid])
    return trajectories


def _check_replayed(trajectories: list[Trajectory], demos: list[Demo]) -> None:
    by_uid = {f"{d.question_id}-{d.sample_index}": d for d in demos}
    for traj in trajectories:
        demo = by_uid[traj.uid]
        assert traj.episode.terminal_reason == "submitted", (traj.uid, traj.episode.terminal_reason)
        assert tuple(traj.prompt_ids + traj.response_ids) == demo.input_ids, traj.uid
        assert tuple(traj.response_mask) == demo.response_mask, traj.uid
        assert len(traj.prompt_ids) == demo.prompt_length
        submit = next(e for e in traj.episode.events if e["type"] == "submit")
        assert submit["payload"]["answer"] == demo.answer and submit["acc"] == demo.acc
        explores = [e for e in traj.episode.events if e["type"] == "explore"]
        assert len(explores) == demo.explores
        assert sum(e["charged_cost_usd"] for e in explores) == pytest.approx(demo.cost_usd, abs=1e-12)


def test_demo_tokens_are_what_the_agent_loop_records(chat, train_questions):
    questions = [q for q in train_questions if q.benchmark == "gpqa"][:6]
    questions += [q for q in train_questions if q.benchmark == "lcb"][:6]
    demos = build_demos(questions, chat, TINY_CPU_LIMITS, TINY_CPU_RUNTIME, per_question=3, seed=0)
    assert len(demos) == 36
    assert len({d.explores for d in demos}) >= 5  # the replay covers many explore counts
    trajectories = _replay(demos, {q.question_id: q for q in questions}, chat, TINY_CPU_LIMITS)
    _check_replayed(trajectories, demos)
    for demo in demos:  # the trained tokens are the scripted turns, each closed by <|im_end|>
        for tokens in _turns(demo):
            assert tokens[-1] == chat.tokenizer.convert_tokens_to_ids("<|im_end|>")
            assert chat.decode_turn(tokens) in (EXPLORE_TURN, submit_turn(demo.answer))


def test_demos_shrink_to_fit_tight_limits_and_still_end_submitted(chat, train_questions):
    limits = LoopLimits(max_response_length=420, max_tokens_per_turn=128, max_model_len=2048)
    questions = [q for q in train_questions if q.benchmark == "lcb"][:10]
    demos = build_demos(questions, chat, limits, TINY_CPU_RUNTIME, per_question=2, seed=0)
    shrunk = [d for d in demos if d.explores < d.planned_explores]
    assert shrunk, "these limits must cut some planned explore counts"
    assert all(len(d.response_ids) <= limits.max_response_length for d in demos)
    trajectories = _replay(demos, {q.question_id: q for q in questions}, chat, limits)
    _check_replayed(trajectories, demos)
    # One explore more than a shrunk demonstration would not have fitted: the loop would stop it.
    demo = shrunk[0]
    question = next(q for q in questions if q.question_id == demo.question_id)
    with pytest.raises(DoesNotFit):
        render_demo(question, demo.sample_index, demo.explores + 1, demo.strategy, chat, limits, TINY_CPU_RUNTIME)


def test_a_question_whose_bare_submit_cannot_fit_is_refused_by_name(chat, train_questions):
    limits = LoopLimits(max_response_length=1024, max_tokens_per_turn=128, max_model_len=500)
    with pytest.raises(ValueError, match=train_questions[0].question_id):
        build_demos(train_questions[:1], chat, limits, TINY_CPU_RUNTIME, per_question=1)


def test_render_demo_refuses_more_explores_than_turns(chat, train_questions):
    with pytest.raises(ValueError, match="max_turns"):
        render_demo(train_questions[0], 0, TINY_CPU_RUNTIME.max_turns, "last", chat, TINY_CPU_LIMITS, TINY_CPU_RUNTIME)
    with pytest.raises(ValueError, match="per_question"):
        build_demos(train_questions[:1], chat, TINY_CPU_LIMITS, TINY_CPU_RUNTIME, per_question=0)


def test_explore_counts_and_answers_are_varied_and_not_the_optimal_policy(chat, train_questions):
    gpqa = [q for q in train_questions if q.benchmark == "gpqa"]
    demos = build_demos(gpqa, chat, TINY_CPU_LIMITS, TINY_CPU_RUNTIME, per_question=4, seed=0)
    counts = Counter(d.explores for d in demos)
    assert sorted(counts) == list(range(9))
    assert all(0.07 < counts[k] / len(demos) < 0.16 for k in range(9)), counts  # about 1/9 each
    strategies = Counter(d.strategy for d in demos)
    for name, weight in SUBMIT_STRATEGIES.items():
        assert abs(strategies[name] / len(demos) - weight) < 0.06, strategies
    # A plain reference policy (reveal everything, submit the most confident answer) does much
    # better at lambda = 0.1: the demonstrations leave PPO room to improve.
    reference = []
    for q in gpqa:
        for perm in q.permutations:
            best = max((q.candidates[i] for i in perm), key=lambda c: c.confidence)
            reference.append(best.is_correct - 0.1 * sum(c.cost_usd for c in q.candidates))
    demo_objective = statistics.mean(d.acc - 0.1 * d.cost_usd for d in demos)
    assert demo_objective < statistics.mean(reference) - 0.1, (demo_objective, statistics.mean(reference))
    # Most submits name a revealed candidate's answer, so copying one is what the model learns.
    assert statistics.mean(d.acc for d in demos if d.explores >= 3) > 0.6


def test_demos_are_deterministic_per_seed(chat, train_questions):
    questions = train_questions[:4] + train_questions[-4:]
    first = build_demos(questions, chat, TINY_CPU_LIMITS, TINY_CPU_RUNTIME, per_question=2, seed=0)
    again = build_demos(questions, chat, TINY_CPU_LIMITS, TINY_CPU_RUNTIME, per_question=2, seed=0)
    other = build_demos(questions, chat, TINY_CPU_LIMITS, TINY_CPU_RUNTIME, per_question=2, seed=1)
    assert first == again
    assert [(d.explores, d.answer) for d in first] != [(d.explores, d.answer) for d in other]


def _gpqa_candidate(letter: str, confidence: float) -> Candidate:
    return Candidate(answer=f"Some working.\nAnswer: {letter}", approach="a", confidence=confidence,
                     cost_usd=0.01, is_correct=letter == "C", solver_model="m")


def _revealed(candidates):
    return [RevealedCandidate(explore_k=k, candidate_idx=k - 1, candidate=c) for k, c in enumerate(candidates, start=1)]


def test_choose_answer_follows_each_strategy():
    cands = [_gpqa_candidate("B", 0.6), _gpqa_candidate("C", 0.9), _gpqa_candidate("B", 0.5),
             _gpqa_candidate("D", 0.9), _gpqa_candidate("A", 0.7)]
    gpqa = Question("g1", "gpqa", "p", "C", tuple(cands))
    revealed = _revealed(cands)
    rng = random.Random(0)
    assert choose_answer("confident", gpqa, revealed, rng) == "C"  # 0.9 twice: the earlier one
    assert choose_answer("majority", gpqa, revealed, rng) == "B"
    assert choose_answer("last", gpqa, revealed, rng) == "A"
    assert {choose_answer("random", gpqa, revealed, random.Random(s)) for s in range(40)} == set("ABCD")
    assert choose_answer("confident", gpqa, [], rng) in set("ABCD")

    code = [Candidate("print(1)", "a", 0.4, 0.1, False, "m"), Candidate("print(2)", "a", 0.8, 0.1, True, "m"),
            Candidate("print(1)\n", "a", 0.3, 0.1, False, "m")]
    lcb = Question("l1", "lcb", "p", "print(2)", tuple(code))
    revealed = _revealed(code)
    assert choose_answer("confident", lcb, revealed, rng) == "#2"
    assert choose_answer("majority", lcb, revealed, rng) == "#1"  # print(1) twice (normalised)
    assert choose_answer("last", lcb, revealed, rng) == "#3"
    assert {choose_answer("random", lcb, revealed, random.Random(s)) for s in range(40)} == {"#1", "#2", "#3"}
    assert choose_answer("majority", lcb, [], rng) == "#1"
    with pytest.raises(ValueError, match="unknown submit strategy 'best'"):
        choose_answer("best", lcb, revealed, rng)


def test_turn_texts_are_calls_the_runtime_executes():
    explore = parse_turn(EXPLORE_TURN)
    assert explore.kind == CALL and explore.call.name == "explore" and explore.call.arguments == {}
    for answer in ("B", "#2", 'say "hi"'):
        submit = parse_turn(submit_turn(answer))
        assert submit.kind == CALL and submit.call.name == "submit" and submit.call.arguments == {"answer": answer}
