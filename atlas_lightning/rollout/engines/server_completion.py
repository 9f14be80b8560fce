"""What a vLLM ``/v1/completions`` reply holds: the sampled token ids and their log-probs, from a
whole reply or from a streamed one chunk by chunk (``stream: true``).

Requests ask for ``logprobs: 0``, ``return_tokens_as_token_ids`` and ``return_token_ids``, so a
choice names each sampled token as ``"token_id:N"`` with its log-prob, and lists the ids once
more as a cross-check: no text is ever re-tokenized. Streamed, vLLM (0.26 and 0.32 alike: the
OpenAI completion route's ``completion_stream_generator``) sends each
chunk's new tokens only (``RequestOutputKind.DELTA``) in the same fields, the finish reason on
the chunk holding the last token, then ``[DONE]``; an error mid-stream comes as an event
``{"error": {...}}``. Who calls it: ``server_engine.ServerEngine``.
"""

from __future__ import annotations

import time
from typing import Optional

from atlas_lightning.rollout.engine import GenerationResult
from atlas_lightning.rollout.engines.server_http import error_message

#: The finish reasons of a completed generation (anything else is an error).
FINISHED = ("stop", "length")


def choice_tokens(choice: dict) -> tuple[list[int], list[float]]:
    """The token ids and log-probs of one choice (or one streamed chunk of it); ``ValueError``
    when they are malformed or disagree."""
    logprobs = choice.get("logprobs") or {}
    token_ids = [int(t.removeprefix("token_id:")) for t in logprobs.get("tokens") or []]
    values = [float(v) for v in logprobs.get("token_logprobs") or []]
    if len(values) != len(token_ids):
        raise ValueError(f"{len(token_ids)} tokens but {len(values)} log-probs")
    if choice.get("token_ids") is not None and list(choice["token_ids"]) != token_ids:
        raise ValueError("token_ids disagree with the log-prob tokens")
    return token_ids, values


class StreamedCompletion:
    """One streamed completion as it arrives (``add`` each event): the tokens and log-probs so
    far, the finish reason once sent, an error once one is seen (later events are ignored)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: Optional[str] = None
        self.error: Optional[str] = None
        self.first_token_at: Optional[float] = None

    def add(self, event: dict | str) -> None:
        if self.error is not None:
            return
        if not isinstance(event, dict) or "status" in event or "error" in event:
            body = event.get("body", event) if isinstance(event, dict) else event
            status = f"HTTP {event['status']}: " if isinstance(event, dict) and "status" in event else ""
            self.error = f"{status}{error_message(body)}"
            return
        try:
            choice = event["choices"][0]
            token_ids, values = choice_tokens(choice)
        except (KeyError, IndexError, TypeError, ValueError) as err:
            self.error = f"malformed stream chunk ({err!r}): {str(event)[:500]}"
            return
        if token_ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.token_ids += token_ids
        self.logprobs += values
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]

    def result(self, request_id: str, *, interrupted: bool = False) -> GenerationResult:
        """The request's result: finished, interrupted (what came before the cut) or an error."""
        first = None if self.first_token_at is None else self.first_token_at - self.started
        if self.error is not None:
            return GenerationResult(request_id, self.token_ids, self.logprobs, "error", error=self.error)
        if self.finish_reason is None and interrupted:
            return GenerationResult(request_id, self.token_ids, self.logprobs, "interrupted", first_token_s=first)
        if self.finish_reason not in FINISHED:
            why = "the stream ended without a finish reason" if self.finish_reason is None else \
                f"finish_reason={self.finish_reason!r}"
            return GenerationResult(request_id, self.token_ids, self.logprobs, "error", error=why)
        return GenerationResult(request_id, self.token_ids, self.logprobs, self.finish_reason, first_token_s=first)
