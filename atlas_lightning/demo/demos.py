"""Scripted demonstrations for the tiny orchestrator's SFT warm start, rendered by the runtime.

Each demonstration is a real ``Episode`` driven by a scripted policy: ``k`` explores, then one
submit. Its tokens are exactly what the agent loop (``rollout/agent_loop.py``) would record if
the model had generated those turns:

- ``prompt_ids``: ``ChatFormat.prompt_ids(episode.messages(), episode.tools())``;
- each assistant turn: ``tokenizer.encode(text)`` + ``<|im_end|>`` (``loss_mask`` 1: trained);
- after each explore: ``ChatFormat.tool_response_ids(reply, turn_closed=True)`` (``loss_mask`` 0).

An assistant turn is only the Hermes call, no reasoning (``EXPLORE_TURN``; ``submit_turn``):
the tiny model's turn budget is 128 tokens, and the two decisions PPO must learn (explore or
submit; which answer) then sit on single tokens.

The scripted policy is deliberately *not* optimal, so that the warm-started policy is diverse
and PPO has something to learn:

- the explore count is uniform over ``0..quota`` (the quota is 8 in the sample); when the
  episode would not fit the loop's limits (long LCB programs can exceed the 1,024-token response
  budget), the count drops to the largest that fits, as a rollout would have to;
- the submitted answer follows one of ``SUBMIT_STRATEGIES`` (``confident``: the most confident
  revealed candidate's answer; ``majority``: the most common revealed answer; ``last``: the
  last revealed; ``random``: a random letter or a random revealed ``#k``). With nothing
  revealed, GPQA guesses a random letter and LCB submits ``#1`` (unrevealed: graded wrong).

Deterministic in ``seed``: every choice comes from a ``random.Random`` keyed by the seed, the
question id and the sample index.

Who calls it: ``tiny_orchestrator.build_tiny_orchestrator``; tests.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass, replace
from typing import Sequence

from atlas_lightning.questions.schema import Question
from atlas_lightning.env.episode import Episode, RuntimeConfig
from atlas_lightning.env.grading import RevealedCandidate, normalize_code, read_choice_letter
from atlas_lightning.config import LoopLimits
from atlas_lightning.rollout.chat import IM_END, ChatFormat

#: The text of an explore turn (the whole assistant turn, before ``<|im_end|>``).
EXPLORE_TURN = '<tool_call>{"name": "explore", "arguments": {}}</tool_call>'
#: How a submitted answer is chosen, and how often (weights).
SUBMIT_STRATEGIES: dict[str, float] = {"confident": 0.35, "majority": 0.25, "last": 0.3, "random": 0.1}
_GPQA_LETTERS = "ABCD"


def submit_turn(answer: str) -> str:
    """The text of a submit turn: ``<tool_call>{"name": "submit", "arguments": {"answer": ...}}</tool_call>``."""
    return "<tool_call>" + json.dumps({"name": "submit", "arguments": {"answer": answer}}) + "</tool_call>"


@dataclass(frozen=True)
class Demo:
    """One demonstration: the token sequence a rollout of these turns records, and what it did.

    ``input_ids`` = prompt + response (``prompt_length`` prompt tokens first); ``loss_mask`` has
    the same length: 1 on generated (assistant) tokens, 0 on the prompt and tool responses.
    ``acc`` and ``cost_usd`` come from the episode's event log.
    """

    question_id: str
    benchmark: str
    sample_index: int
    planned_explores: int
    explores: int
    strategy: str
    answer: str
    acc: int
    cost_usd: float
    prompt_length: int
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]

    @property
    def response_ids(self) -> tuple[int, ...]:
        return self.input_ids[self.prompt_length:]

    @property
    def response_mask(self) -> tuple[int, ...]:
        return self.loss_mask[self.prompt_length:]


def _answer_key(benchmark: str, revealed: RevealedCandidate) -> str:
    """What two candidates must share to count as the same answer."""
    if benchmark == "gpqa":
        return read_choice_letter(revealed.candidate.answer) or ""
    return normalize_code(revealed.candidate.answer)


def choose_answer(strategy: str, question: Question, revealed: Sequence[RevealedCandidate], rng: random.Random) -> str:
    """The answer a submit carries under ``strategy``: a letter (GPQA) or ``#k`` (LCB).

    Ties go to the earliest revealed candidate. A GPQA candidate whose letter cannot be read
    leads to a random letter (the sample's candidates always end in ``Answer: X``).
    """
    if strategy not in SUBMIT_STRATEGIES:
        raise ValueError(f"unknown submit strategy {strategy!r}; known: {', '.join(SUBMIT_STRATEGIES)}")
    gpqa = question.benchmark == "gpqa"
    if not revealed:
        return rng.choice(_GPQA_LETTERS) if gpqa else "#1"
    if strategy == "random":
        return rng.choice(_GPQA_LETTERS) if gpqa else f"#{rng.randint(1, len(revealed))}"
    if strategy == "last":
        chosen = revealed[-1]
    elif strategy == "confident":
        chosen = max(revealed, key=lambda r: (r.candidate.confidence, -r.explore_k))
    else:  # majority: the most common answer; among equally common ones, the first revealed
        counts = Counter(_answer_key(question.benchmark, r) for r in revealed)
        chosen = max(revealed, key=lambda r: (counts[_answer_key(question.benchmark, r)], -r.explore_k))
    if not gpqa:
        return f"#{chosen.explore_k}"
    return _answer_key("gpqa", chosen) or rng.choice(_GPQA_LETTERS)


class DoesNotFit(ValueError):
    """The scripted episode would be ended by a loop limit (``response_length`` or
    ``context_overflow``) before its submit."""


def _turn_tokens(chat: ChatFormat, text: str) -> list[int]:
    ids = list(chat.tokenizer.encode(text, add_special_tokens=False))
    ids.append(chat.tokenizer.convert_tokens_to_ids(IM_END))
    if chat.decode_turn(ids) != text:  # the runtime must read back exactly the scripted turn
        raise ValueError(f"turn text does not round-trip through the tokenizer: {text!r}")
    return ids


def render_demo(
    question: Question,
    sample_index: int,
    explores: int,
    strategy: str,
    chat: ChatFormat,
    limits: LoopLimits,
    runtime: RuntimeConfig,
    seed: int = 0,
    rng: random.Random | None = None,
) -> Demo:
    """Drive a real ``Episode`` through ``explores`` explores and a submit; return its tokens.

    Raises ``DoesNotFit`` when the agent loop's ``limits`` would end the episode first (the same
    rules as ``AgentLoop._next_request``/``_apply_turn``), and ``ValueError`` if the episode does
    not end ``submitted`` (a scripted turn the runtime refused).
    """
    if not 0 <= explores <= runtime.max_turns - 1:
        raise ValueError(f"explores={explores} needs {explores + 1} turns; max_turns is {runtime.max_turns}")
    rng = rng if rng is not None else random.Random(0)
    episode = Episode(question, sample_index, runtime, seed=seed)
    prompt = chat.prompt_ids(episode.messages(), episode.tools())
    episode.on_prompt_tokens(len(prompt))
    response: list[int] = []
    mask: list[int] = []

    def generate(text: str) -> tuple[int, int]:
        used = len(response)
        room = min(limits.max_tokens_per_turn, limits.max_response_length - used,
                   limits.max_model_len - len(prompt) - used)
        ids = _turn_tokens(chat, text)
        if len(ids) > room:
            raise DoesNotFit(f"a {len(ids)}-token turn with room for {room}")
        response.extend(ids)
        mask.extend([1] * len(ids))
        return used, len(response)

    for _ in range(explores):
        start, end = generate(EXPLORE_TURN)
        reply = episode.on_assistant_turn(EXPLORE_TURN, start, end)
        if reply is None:
            raise ValueError(f"{question.question_id}: the runtime ended the episode on an explore "
                             f"({episode.terminal_reason})")
        tool = chat.tool_response_ids(reply, turn_closed=True)
        new_len = end + len(tool)
        if len(prompt) + new_len >= limits.max_model_len or new_len >= limits.max_response_length:
            raise DoesNotFit(f"the tool response ends at {new_len}")
        response.extend(tool)
        mask.extend([0] * len(tool))
        episode.on_tool_response_tokens(end, new_len)

    answer = choose_answer(strategy, question, episode.revealed, rng)
    text = submit_turn(answer)
    start, end = generate(text)
    episode.on_assistant_turn(text, start, end)
    if episode.terminal_reason != "submitted":
        raise ValueError(f"{question.question_id}: scripted episode ended {episode.terminal_reason}, not submitted")
    submit = next(e for e in episode.events if e["type"] == "submit")
    cost = sum(e["charged_cost_usd"] for e in episode.events if e["type"] == "explore")
    return Demo(
        question_id=question.question_id, benchmark=question.benchmark, sample_index=sample_index,
        planned_explores=explores, explores=len(episode.revealed), strategy=strategy, answer=answer,
        acc=int(submit["acc"]), cost_usd=float(cost), prompt_length=len(prompt),
        input_ids=tuple(prompt + response), loss_mask=tuple([0] * len(prompt) + mask),
    )


def plan_demo(question: Question, sample_index: int, runtime: RuntimeConfig,
              seed: int) -> tuple[int, str, random.Random]:
    """(explore count, submit strategy, the rng for the rest) of one demonstration."""
    rng = random.Random(f"atlas-sft-demo/{seed}/{question.benchmark}/{question.question_id}/{sample_index}")
    quota = min(runtime.max_explores, len(question.candidates), runtime.max_turns - 1)
    explores = rng.randint(0, quota)
    strategy = rng.choices(list(SUBMIT_STRATEGIES), weights=list(SUBMIT_STRATEGIES.values()))[0]
    return explores, strategy, rng


def build_demos(
    questions: Sequence[Question],
    chat: ChatFormat,
    limits: LoopLimits,
    runtime: RuntimeConfig,
    *,
    per_question: int,
    seed: int = 0,
) -> list[Demo]:
    """``per_question`` demonstrations of each question (sample indices ``0..per_question-1``,
    i.e. different reveal orders), in question order.

    A planned explore count that does not fit the limits is lowered to the largest that does
    (``Demo.planned_explores`` keeps the plan, ``Demo.explores`` what was done). A question whose
    prompt plus a bare submit does not fit raises ``ValueError`` naming it.
    """
    if per_question < 1:
        raise ValueError(f"per_question must be >= 1, got {per_question}")
    demos = []
    for question in questions:
        for sample_index in range(per_question):
            explores, strategy, rng = plan_demo(question, sample_index, runtime, seed)
            state = rng.getstate()
            for count in range(explores, -1, -1):
                rng.setstate(state)  # the same answer draw whatever count finally fits
                try:
                    demo = render_demo(question, sample_index, count, strategy, chat, limits, runtime, seed, rng)
                except DoesNotFit:
                    continue
                demos.append(replace(demo, planned_explores=explores))
                break
            else:
                raise ValueError(f"question {question.question_id}: not even a bare submit fits the loop's "
                                 f"limits ({limits})")
    return demos
