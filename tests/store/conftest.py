"""Builders shared by the runtime tests: questions, tool-call texts, a driver with fake offsets."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from atlas_lightning.questions.schema import Candidate, Question


def make_question(benchmark="gpqa", costs=(0.12, 0.5, 0.003, 0.0), correct=(False, True, False, False),
                  answers=None, permutations=((0, 1, 2, 3),), ground_truth="B", question_id="q-1"):
    if answers is None:
        answers = [("ABCD"[i % 4] if benchmark == "gpqa" else f"def solve():\n    return {i}\n") for i in range(len(costs))]
    candidates = tuple(
        Candidate(answer=a, approach=f"approach {i}", confidence=0.5 + 0.05 * i, cost_usd=c, is_correct=ok,
                  solver_model=f"solver-{i}")
        for i, (a, c, ok) in enumerate(zip(answers, costs, correct))
    )
    return Question(question_id=question_id, benchmark=benchmark, problem="What is it?\n(A) 1 (B) 2 (C) 3 (D) 4",
                    ground_truth=ground_truth, candidates=candidates, permutations=tuple(permutations))


def call(name, arguments=None):
    body = {"name": name} if arguments is None else {"name": name, "arguments": arguments}
    return f"<tool_call>{json.dumps(body)}</tool_call>"


def run_turns(episode, texts, turn_len=5, response_len=7, gap=0):
    """Feed ``texts`` as consecutive turns, each ``turn_len`` tokens, responses ``response_len``
    tokens; returns the replies. Stops early when the episode ends."""
    replies, cursor = [], 0
    for text in texts:
        start, end = cursor + gap, cursor + gap + turn_len
        reply = episode.on_assistant_turn(text, start, end)
        replies.append(reply)
        if reply is None:
            break
        episode.on_tool_response_tokens(end, end + response_len)
        cursor = end + response_len
    return replies


@pytest.fixture(scope="session")
def build():
    return SimpleNamespace(question=make_question, call=call, run=run_turns)
