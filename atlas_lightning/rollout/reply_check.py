"""What every engine's reply must be before the agent loop takes it (``reply_problem``).

Whatever serves a rollout (the in-process vLLM engine, vLLM's server, the transformers
reference engine, a plugin named by ``rollout.engine``), a finished or interrupted request's
result carries one log-prob per sampled token, no more tokens than the request asked for,
every token id inside the model's vocabulary (``Engine.vocab_size``; unknown: ids are only
checked >= 0) and every log-prob a finite number <= 0 (the log of a probability, with
``LOGPROB_SLACK`` for the rounding of a log-softmax). The agent loop applies it once, where
each result enters (``AgentLoop._checked``): a reply that is not so becomes an error result
naming what is wrong, retried as any failed request and, past ``rollout.max_retries``, an
``EngineError`` naming the engine and the request (exit 4); it is never trained on. A valid
reply passes as it came, the same object.

The checks are vectorised (numpy over the whole reply), so a long response costs no Python
loop per token.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from atlas_lightning.rollout.engine import GenerationRequest, GenerationResult

#: How far above 0 a sampled token's log-prob may be (float rounding of a log-softmax).
LOGPROB_SLACK = 1e-4


def tokens_problem(token_ids: Sequence[int], logprobs: Sequence[float], max_tokens: int,
                   vocab_size: Optional[int] = None) -> Optional[str]:
    """Whether ``token_ids`` with ``logprobs`` cannot be a reply to a request for at most
    ``max_tokens`` tokens (module doc); None when they can."""
    if len(token_ids) > max_tokens:
        return f"{len(token_ids)} tokens, more than the {max_tokens} asked for"
    if len(logprobs) != len(token_ids):
        return f"{len(token_ids)} tokens but {len(logprobs)} log-probs"
    if not len(token_ids):
        return None
    try:
        given = np.asarray(token_ids)
        ids = np.asarray(token_ids, dtype=np.int64)
        values = np.asarray(logprobs, dtype=np.float64)
    except (TypeError, ValueError, OverflowError) as err:
        return f"its token ids or log-probs are not numbers ({err})"
    if given.dtype.kind not in "iu":  # a cast to int64 would truncate 5.7 to 5 without a word
        return f"its token ids are not integers (they are {given.dtype}: {given.reshape(-1)[:3].tolist()}...)"
    outside = (ids < 0) if vocab_size is None else ((ids < 0) | (ids >= vocab_size))
    if outside.any():
        top = "" if vocab_size is None else f"..{vocab_size - 1}"
        return f"token id {int(ids[np.argmax(outside)])} is outside the vocabulary (0{top})"
    bad = ~np.isfinite(values) | (values > LOGPROB_SLACK)
    if bad.any():
        return f"the log-prob {float(values[np.argmax(bad)])} of a sampled token is not a finite number <= 0"
    return None


def reply_problem(request: GenerationRequest, result: GenerationResult,
                  vocab_size: Optional[int] = None) -> Optional[str]:
    """Whether ``result`` (not an error result) cannot be ``request``'s reply (module doc)."""
    return tokens_problem(result.token_ids, result.logprobs, request.sampling.max_tokens, vocab_size)


def checked(request: GenerationRequest, result: GenerationResult, engine: str,
            vocab_size: Optional[int] = None) -> GenerationResult:
    """``result`` as it came, or an error result naming ``engine`` and what makes it impossible."""
    if result.error is not None:
        return result
    problem = reply_problem(request, result, vocab_size)
    if problem is None:
        return result
    return GenerationResult(result.request_id, [], [], "error", error=f"a bad reply from the {engine} engine: {problem}")
