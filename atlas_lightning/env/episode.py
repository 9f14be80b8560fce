"""One trajectory's explore-cost runtime (README, "An episode"). Pure Python: it knows nothing of tokens
except the response-token offsets the rollout layer tells it.

How the rollout layer drives it::

    episode = Episode(question, sample_index, RuntimeConfig(max_explores=8, max_turns=9), seed)
    prompt = tokenizer.apply_chat_template(episode.messages(), tools=episode.tools(), ...)
    while not episode.done:
        text, start, end = <generate one assistant turn; its tokens sit at response[start:end]>
        reply = episode.on_assistant_turn(text, start, end)
        if reply is None:
            break                                   # the runtime ended the episode
        <append <tool_response>reply</tool_response> as the next user turn, mask 0>
        if <it does not fit>:
            episode.stop("response_length")         # or "context_overflow"
        else:
            episode.on_tool_response_tokens(resp_start, resp_end)
    record_episode = episode.to_record_episode()    # -> reward.score_episode(record_episode, ...)

A turn truncated by the response budget is not executed: pass it to
``stop("response_length", last_generated=end - 1, text=text, start=start)``.

Decisions (each one is terminal unless said otherwise):

- ``submitted``: a well-formed ``submit``. Graded at once (``grading.py``); an unreadable letter, an
  unrevealed or out-of-range ``#k`` or an empty answer is still a submit, graded wrong.
- ``no_tool_call``: a turn without a tool call (``parsing.py`` rule 2).
- ``malformed_call``: bad JSON, an unknown tool, bad arguments, stray/nested/unclosed tags.
- ``max_turns``: after the ``max_turns``-th assistant turn if it did not end the episode. An
  explore made on that last turn is executed and charged (the call was made) although its
  response is never shown; so its explore reward and the terminal reward share a token.
- ``response_length`` / ``context_overflow``: only from ``stop``; the terminal token is the last
  generated token (by default the last turn's last token).
- Not terminal: an explore (reveals the next candidate of this trajectory's permutation and charges
  its ``cost_usd``); an explore beyond the quota (reveals nothing, charges nothing, says so); a
  turn with several calls (the first is executed, the rest ignored and the response says so).
- The quota is ``min(max_explores, len(question.candidates))``: once every candidate has been
  revealed, a further explore is "beyond the quota" too.

The event log (``events``, JSON-ready dicts in order; the reward reads nothing else):

- ``{"type": "explore", "turn", "explore_k", "candidate_idx", "offsets": [start, end],
  "charged_cost_usd", "is_correct", "tool_response", "tool_response_offsets"}``: ``offsets`` are
  the assistant turn's response-token span (its last token is ``end - 1``); ``candidate_idx``
  indexes ``question.candidates``; ``is_correct`` is the cached grade (read by the reward's
  ``found_correct``; never shown to the model).
- ``{"type": "explore_over_quota", "turn", "offsets", "charged_cost_usd": 0.0, "tool_response",
  "tool_response_offsets"}``.
- ``{"type": "submit", "turn", "offsets", "payload": {"answer"}, "grading", "acc"}``.
- ``{"type": "terminal", "turn", "terminal_reason", "terminal_reason_code", "last_generated"}``:
  always the last event; ``last_generated`` is ``None`` only if no token was ever generated.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from atlas_lightning.questions.schema import BENCHMARKS, Question
from atlas_lightning.env.grading import RevealedCandidate, grade_gpqa, grade_lcb, read_choice_letter
from atlas_lightning.env.parsing import MALFORMED, NO_CALL, ParsedTurn, parse_turn
from atlas_lightning.env.permutation import candidate_fingerprint, choose_permutation
from atlas_lightning.env.prompts import system_message, user_message
from atlas_lightning.env.render import ignored_calls_note, render_candidate, render_quota_spent
from atlas_lightning.env.terminal import EXTERNAL_REASONS, terminal_reason_code
from atlas_lightning.env.tools import SUBMIT, tool_schemas


@dataclass(frozen=True)
class RuntimeConfig:
    """The runtime's limits (``rollout.max_explores``, ``rollout.max_turns`` in the config)."""

    max_explores: int = 8
    max_turns: int = 9

    def __post_init__(self) -> None:
        for name, low in (("max_explores", 0), ("max_turns", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"RuntimeConfig.{name} must be an int >= {low}, got {value!r}")

    @classmethod
    def from_rollout_config(cls, rollout: object) -> "RuntimeConfig":
        """From any object with ``max_explores`` and ``max_turns`` (e.g. ``cfg.rollout``)."""
        return cls(max_explores=int(rollout.max_explores), max_turns=int(rollout.max_turns))


def _check_question(question: Question) -> str | None:
    """Refuse a question the runtime cannot grade; returns the GPQA ground-truth letter."""
    where = f"question {question.question_id!r}"
    if question.benchmark not in BENCHMARKS:
        raise ValueError(f"{where}: benchmark {question.benchmark!r} is not one of {', '.join(BENCHMARKS)}")
    if not question.candidates:
        raise ValueError(f"{where}: has no candidates")
    for i, candidate in enumerate(question.candidates):
        cost = candidate.cost_usd
        if not isinstance(cost, (int, float)) or isinstance(cost, bool) or not math.isfinite(cost) or cost < 0:
            raise ValueError(f"{where}: candidates[{i}].cost_usd={cost!r} must be a finite number >= 0")
        if not isinstance(candidate.confidence, (int, float)) or isinstance(candidate.confidence, bool):
            raise ValueError(f"{where}: candidates[{i}].confidence={candidate.confidence!r} must be a number")
        for name in ("answer", "approach"):
            if not isinstance(getattr(candidate, name), str):
                raise ValueError(f"{where}: candidates[{i}].{name} must be a string")
    if question.benchmark != "gpqa":
        return None
    letter = read_choice_letter(question.ground_truth or "")
    if letter is None:
        raise ValueError(f"{where}: ground_truth {question.ground_truth!r} is not a choice letter")
    return letter


def _is_offset(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class Episode:
    """One trajectory's runtime; see the module docstring for the protocol and the event log.

    Public state: ``permutation_id``, ``permutation`` (indices into ``question.candidates``, in
    reveal order), ``candidate_fingerprint``, ``explore_quota``, ``done``, ``terminal_reason``,
    ``events``, ``generations``, ``proposed_calls`` (read them; do not mutate them).
    """

    def __init__(self, question: Question, sample_index: int, config: RuntimeConfig | None = None, seed: int = 0):
        self.config = config if config is not None else RuntimeConfig()
        self._gpqa_letter = _check_question(question)
        self.question = question
        self.sample_index = sample_index
        self.seed = seed
        self.permutation_id, self.permutation = choose_permutation(question, sample_index, seed)
        self.candidate_fingerprint = candidate_fingerprint(question.candidates, self.permutation)
        self.explore_quota = min(self.config.max_explores, len(question.candidates))
        self.done = False
        self.terminal_reason: str | None = None
        self.events: list[dict] = []
        self.generations: list[dict] = []
        self.proposed_calls: list[dict] = []
        self.prompt_tokens: int | None = None
        self._revealed: list[RevealedCandidate] = []
        self._cursor = 0  # end of the last span recorded (turn or tool response)
        self._last_generated: int | None = None
        self._awaiting: tuple[dict, dict] | None = None  # (generation, event) whose response is pending

    # ------------------------------------------------------------------ what the model is given

    def messages(self) -> list[dict]:
        """``[{"role": "system", ...}, {"role": "user", ...}]`` for the chat template."""
        bench = self.question.benchmark
        return [
            {"role": "system", "content": system_message(bench, self.explore_quota, self.config.max_turns)},
            {"role": "user", "content": user_message(bench, self.question.problem, self.explore_quota)},
        ]

    def tools(self) -> list[dict]:
        """The JSON schemas for the chat template's ``tools=``."""
        return tool_schemas(self.question.benchmark)

    @property
    def revealed(self) -> tuple[RevealedCandidate, ...]:
        return tuple(self._revealed)

    @property
    def num_turns(self) -> int:
        return len(self.generations)

    # ------------------------------------------------------------------ driven by the rollout layer

    def on_prompt_tokens(self, count: int) -> None:
        """Optional: the prompt's token count, for the record's ``token_counts``."""
        if not _is_offset(count):
            raise ValueError(f"on_prompt_tokens: count must be an int >= 0, got {count!r}")
        self.prompt_tokens = count

    def on_assistant_turn(self, text: str, start: int, end: int) -> str | None:
        """Execute the turn whose generated tokens sit at ``response[start:end]``.

        Returns the tool-response content (to wrap in ``<tool_response>``), or ``None`` when the
        episode has ended (submitted, no_tool_call, malformed_call, max_turns). Never raises on the
        text's content; raises ``TypeError``/``ValueError``/``RuntimeError`` on protocol misuse.
        """
        self._require_running("on_assistant_turn")
        if self._awaiting is not None:
            raise RuntimeError(
                f"on_assistant_turn: turn {self._awaiting[0]['turn']} returned a tool response; "
                "call on_tool_response_tokens (or stop) first"
            )
        if not isinstance(text, str):
            raise TypeError(f"on_assistant_turn: text must be the decoded str, got {type(text).__name__}")
        self._check_span("on_assistant_turn", start, end)
        turn = len(self.generations) + 1
        generation = {
            "turn": turn, "text": text, "offsets": [start, end],
            "tool_response": None, "tool_response_offsets": None, "truncated": False,
        }
        self.generations.append(generation)
        self._cursor = end
        self._last_generated = end - 1

        parsed = parse_turn(text)
        self._record_proposed(turn, parsed)
        if parsed.kind == NO_CALL:
            return self._finish("no_tool_call")
        if parsed.kind == MALFORMED:
            return self._finish("malformed_call")
        if parsed.call.name == SUBMIT:
            self._submit(turn, start, end, parsed.call.arguments["answer"])
            return self._finish("submitted")

        event = self._explore(turn, start, end)
        if parsed.ignored_count:
            event["tool_response"] = ignored_calls_note(parsed.ignored_count) + "\n" + event["tool_response"]
        generation["tool_response"] = event["tool_response"]
        if turn >= self.config.max_turns:
            return self._finish("max_turns")
        self._awaiting = (generation, event)
        return event["tool_response"]

    def on_tool_response_tokens(self, start: int, end: int) -> None:
        """Where the last tool response landed in the response (``response_mask`` 0 there)."""
        self._require_running("on_tool_response_tokens")
        if self._awaiting is None:
            raise RuntimeError("on_tool_response_tokens: no tool response is pending")
        self._check_span("on_tool_response_tokens", start, end)
        generation, event = self._awaiting
        generation["tool_response_offsets"] = [start, end]
        event["tool_response_offsets"] = [start, end]
        self._cursor = end
        self._awaiting = None

    def stop(self, reason: str, last_generated: int | None = None, *, text: str | None = None,
             start: int | None = None) -> None:
        """End the episode from outside: ``response_length`` or ``context_overflow``.

        ``last_generated``: the response position of the last generated token (the terminal
        reward's token); ``None`` means the last recorded turn's last token. A turn cut short by
        the budget may be passed as ``text`` with its ``start`` (then ``last_generated`` is its
        last token): it is recorded as a truncated generation and never executed.
        """
        if reason not in EXTERNAL_REASONS:
            raise ValueError(f"stop: reason must be one of {', '.join(EXTERNAL_REASONS)}, got {reason!r}")
        self._require_running("stop")
        self._awaiting = None  # a pending response that did not fit never reached the model
        if text is not None:
            if not isinstance(text, str):
                raise TypeError(f"stop: text must be the decoded str, got {type(text).__name__}")
            if start is None or last_generated is None:
                raise ValueError("stop: a truncated turn needs both start and last_generated")
            if not _is_offset(last_generated):
                raise ValueError(f"stop: last_generated must be an int >= 0, got {last_generated!r}")
            self._check_span("stop", start, last_generated + 1)
            self.generations.append({
                "turn": len(self.generations) + 1, "text": text, "offsets": [start, last_generated + 1],
                "tool_response": None, "tool_response_offsets": None, "truncated": True,
            })
            self._cursor = last_generated + 1
        elif last_generated is not None:
            known = self._last_generated
            if not _is_offset(last_generated) or not (last_generated == known or last_generated >= self._cursor):
                raise ValueError(
                    f"stop: last_generated={last_generated!r} must be the last turn's last token ({known}) "
                    f"or a later generated position (>= {self._cursor})"
                )
        else:
            last_generated = self._last_generated
        self._last_generated = last_generated
        self._finish(reason)

    # ------------------------------------------------------------------ the record

    def to_record_episode(self) -> dict:
        """The record's ``episode`` field (JSON-ready, a deep copy); only once the episode ended."""
        if not self.done:
            raise RuntimeError("to_record_episode: the episode has not ended yet")
        generated = sum(g["offsets"][1] - g["offsets"][0] for g in self.generations)
        tool = sum(g["tool_response_offsets"][1] - g["tool_response_offsets"][0]
                   for g in self.generations if g["tool_response_offsets"])
        return copy.deepcopy({
            "question_id": self.question.question_id,
            "benchmark": self.question.benchmark,
            "sample_index": self.sample_index,
            "permutation_id": self.permutation_id,
            "permutation": list(self.permutation),
            "candidate_fingerprint": self.candidate_fingerprint,
            "max_explores": self.config.max_explores,
            "explore_quota": self.explore_quota,
            "max_turns": self.config.max_turns,
            "num_turns": self.num_turns,
            "generations": self.generations,
            "proposed_calls": self.proposed_calls,
            "events": self.events,
            "terminal_reason": self.terminal_reason,
            "terminal_reason_code": terminal_reason_code(self.terminal_reason),
            # "response": the end of the last span the runtime was told about.
            "token_counts": {"prompt": self.prompt_tokens, "response": self._cursor,
                             "generated": generated, "tool_response": tool},
        })

    # ------------------------------------------------------------------ internals

    def _require_running(self, method: str) -> None:
        if self.done:
            raise RuntimeError(f"{method}: the episode already ended ({self.terminal_reason})")

    def _check_span(self, method: str, start: object, end: object) -> None:
        if not _is_offset(start) or not _is_offset(end):
            raise ValueError(f"{method}: offsets must be ints >= 0, got start={start!r}, end={end!r}")
        if end <= start:
            raise ValueError(f"{method}: empty or reversed span [{start}, {end})")
        if start < self._cursor:
            raise ValueError(
                f"{method}: span [{start}, {end}) starts before the end of what was already recorded "
                f"({self._cursor}); spans must come in response order"
            )

    def _record_proposed(self, turn: int, parsed: ParsedTurn) -> None:
        if parsed.kind == NO_CALL:
            return
        if parsed.kind == MALFORMED:
            self.proposed_calls.append({"turn": turn, "status": "malformed", "error": parsed.error, "body": parsed.body})
            return
        self.proposed_calls.append({
            "turn": turn, "status": "executed", "name": parsed.call.name,
            "arguments": parsed.call.arguments, "body": parsed.body,
        })
        for body in parsed.ignored_bodies:
            self.proposed_calls.append({"turn": turn, "status": "ignored", "body": body})
        unrecorded = parsed.ignored_count - len(parsed.ignored_bodies)
        if unrecorded:  # counted, not copied: the turn's text is in the record's generations
            self.proposed_calls.append({"turn": turn, "status": "ignored_unrecorded", "count": unrecorded})

    def _explore(self, turn: int, start: int, end: int) -> dict:
        if len(self._revealed) >= self.explore_quota:
            event = {
                "type": "explore_over_quota", "turn": turn, "offsets": [start, end], "charged_cost_usd": 0.0,
                "tool_response": render_quota_spent(self.explore_quota), "tool_response_offsets": None,
            }
        else:
            k = len(self._revealed) + 1
            index = self.permutation[k - 1]
            candidate = self.question.candidates[index]
            self._revealed.append(RevealedCandidate(explore_k=k, candidate_idx=index, candidate=candidate))
            event = {
                "type": "explore", "turn": turn, "explore_k": k, "candidate_idx": index, "offsets": [start, end],
                "charged_cost_usd": float(candidate.cost_usd), "is_correct": bool(candidate.is_correct),
                "tool_response": render_candidate(self.question.benchmark, k, candidate, k, self.explore_quota),
                "tool_response_offsets": None,
            }
        self.events.append(event)
        return event

    def _submit(self, turn: int, start: int, end: int, answer: str) -> None:
        if self.question.benchmark == "gpqa":
            grading = grade_gpqa(answer, self._gpqa_letter)
        else:
            grading = grade_lcb(answer, self._revealed)
        self.events.append({
            "type": "submit", "turn": turn, "offsets": [start, end],
            "payload": {"answer": answer}, "grading": grading, "acc": grading["acc"],
        })

    def _finish(self, reason: str) -> None:
        self.events.append({
            "type": "terminal", "turn": len(self.generations), "terminal_reason": reason,
            "terminal_reason_code": terminal_reason_code(reason), "last_generated": self._last_generated,
        })
        self.terminal_reason = reason
        self.done = True
        return None
