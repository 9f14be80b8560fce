"""What a vLLM ``/v1/completions`` reply holds: the sampled token ids and their log-probs, from a
whole reply or from a streamed one chunk by chunk (``stream: true``).

Requests ask for ``logprobs: 0``, ``return_tokens_as_token_ids`` and ``return_token_ids``, so a
choice names each sampled token as ``"token_id:N"`` with its log-prob, and lists the ids once
more as a cross-check: no text is ever re-tokenized. Streamed, vLLM (0.26 and 0.32 alike: the
OpenAI completion route's ``completion_stream_generator``) sends each
chunk's new tokens only (``RequestOutputKind.DELTA``) in the same fields, the finish reason on
the chunk holding the last token, then ``[DONE]``; an error mid-stream comes as an event
``{"error": {...}}``. Who calls it: ``server_engine.ServerEngine``.

A reply is never trusted as it comes (``ReplyCheck``): it must be for the request sent (its
``id`` is ``cmpl-<the X-Request-Id sent>`` where the server echoes it, its ``prompt_token_ids``
the prompt sent where it returns them), carry a log-prob for every token, no more tokens than
asked for, every token id inside the model's vocabulary and every log-prob a finite number
<= 0 (the log of a probability). A reply that is not so becomes an error result naming what is
wrong, which the agent loop retries and, past ``rollout.max_retries``, stops the run on
(``EngineError``: exit 4), naming the engine and the request: it is never trained on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

from atlas_lightning.rollout.engine import GenerationRequest, GenerationResult
from atlas_lightning.rollout.engines.server_http import error_message, quoted
from atlas_lightning.rollout.reply_check import tokens_problem

#: The finish reasons of a completed generation (anything else is an error).
FINISHED = ("stop", "length")
#: The prefix of the request ids this client sends (``X-Request-Id``): a reply whose id carries
#: it but is not its request's answers another request of ours.
ID_PREFIX = "atlas-"


def choice_tokens(choice: dict) -> tuple[list[int], list[float]]:
    """The token ids and log-probs of one choice (or one streamed chunk of it); ``ValueError``
    when they are malformed, missing or disagree."""
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict):
        raise ValueError("the reply carries no log-probs (its 'logprobs' is missing)")
    token_ids = [int(t.removeprefix("token_id:")) for t in logprobs.get("tokens") or []]
    values = [float(v) for v in logprobs.get("token_logprobs") or []]
    if len(values) != len(token_ids):
        raise ValueError(f"{len(token_ids)} tokens but {len(values)} log-probs")
    if choice.get("token_ids") is not None and list(choice["token_ids"]) != token_ids:
        raise ValueError("token_ids disagree with the log-prob tokens")
    return token_ids, values


@dataclass(frozen=True)
class ReplyCheck:
    """What a reply to one request must match (module doc). ``sent_id``: the ``X-Request-Id``
    sent; ``vocab_size``: the model's (None: unknown, ids are then only checked >= 0)."""

    request: GenerationRequest
    sent_id: str
    vocab_size: Optional[int] = None

    def identity_problem(self, reply: dict) -> Optional[str]:
        """Whether ``reply`` (a whole reply or a streamed chunk) answers another request."""
        got = reply.get("id")  # vLLM's: cmpl-<the id sent>; a server that ignores it names its own
        if isinstance(got, str) and ID_PREFIX in got and self.sent_id not in got:
            return f"the reply is for request {got!r}, not this one (cmpl-{self.sent_id})"
        choices = reply.get("choices")
        prompt = choices[0].get("prompt_token_ids") if isinstance(choices, list) and choices and \
            isinstance(choices[0], dict) else None
        if prompt is not None and list(prompt) != list(self.request.prompt_ids):
            return (f"the reply is for another prompt ({len(prompt)} tokens, not the {len(self.request.prompt_ids)} "
                    f"sent)")
        return None

    def tokens_problem(self, token_ids: list[int], logprobs: list[float]) -> Optional[str]:
        """Whether the tokens of a reply cannot be this request's (``reply_check.tokens_problem``,
        the check the agent loop applies to every engine's replies)."""
        return tokens_problem(token_ids, logprobs, self.request.sampling.max_tokens, self.vocab_size)

    def result(self, result: GenerationResult) -> GenerationResult:
        """``result`` as it is, or an error result naming what makes its tokens impossible."""
        if result.error is not None:
            return result
        problem = self.tokens_problem(result.token_ids, result.logprobs)
        if problem is None:
            return result
        return GenerationResult(result.request_id, [], [], "error", error=f"a bad reply: {problem}")


def _malformed(event: Any) -> str:
    return f"malformed stream event: {quoted(event)}"


class StreamedCompletion:
    """One streamed completion as it arrives (``add`` each event): the tokens and log-probs so
    far, the finish reason once sent, an error once one is seen (later events are ignored).
    ``check``: what its events must match (``ReplyCheck``; None: nothing checked)."""

    def __init__(self, check: Optional[ReplyCheck] = None) -> None:
        self.check = check
        self.started = time.monotonic()
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: Optional[str] = None
        self.error: Optional[str] = None
        self.first_token_at: Optional[float] = None

    def add(self, event: dict | str) -> None:
        if self.error is not None:
            return
        if not isinstance(event, dict):  # a data line that is not JSON
            self.error = _malformed(event)
            return
        if "status" in event or "error" in event:
            body = event.get("body", event)
            status = f"HTTP {event['status']}: " if "status" in event else ""
            self.error = f"{status}{error_message(body)}"
            return
        try:
            choice = event["choices"][0]
            token_ids, values = choice_tokens(choice)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:
            self.error = f"malformed stream chunk ({quoted(repr(err), 80)}): {quoted(event)}"
            return
        problem = self.check.identity_problem(event) if self.check is not None else None
        if problem is None and self.finish_reason is not None and token_ids:
            problem = f"tokens came after the finish reason {self.finish_reason!r}"
        if problem is not None:
            self.error = f"a bad reply: {problem}"
            return
        if token_ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.token_ids += token_ids
        self.logprobs += values
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]

    def result(self, request_id: str, *, interrupted: bool = False) -> GenerationResult:
        """The request's result: finished, interrupted (what came before the cut) or an error
        (a reply its ``check`` refuses included)."""
        first = None if self.first_token_at is None else self.first_token_at - self.started
        if self.error is not None:
            return GenerationResult(request_id, self.token_ids, self.logprobs, "error", error=self.error)
        if self.finish_reason is None and interrupted:
            result = GenerationResult(request_id, self.token_ids, self.logprobs, "interrupted", first_token_s=first)
        elif self.finish_reason not in FINISHED:
            why = "the stream ended without a finish reason" if self.finish_reason is None else \
                f"finish_reason={self.finish_reason!r}"
            return GenerationResult(request_id, self.token_ids, self.logprobs, "error", error=why)
        else:
            result = GenerationResult(request_id, self.token_ids, self.logprobs, self.finish_reason,
                                      first_token_s=first)
        return result if self.check is None else self.check.result(result)
