"""The engine interface: what the agent loop asks of a rollout engine, whatever serves it.

An engine takes token-ID requests and hands back finished generations, with the log-prob of
each sampled token. Requests are submitted without waiting (``submit``) and collected as they
finish (``poll``), so one loop drives continuous batching across the turns of many episodes.
Every request carries its own sampling seed, which makes a trajectory's tokens a function of
(seed, weights, prompt) and not of which other requests shared the batch.

Implementations: ``vllm_engine.VLLMEngine`` (in-process ``vllm.LLM``), ``server_engine``
(vLLM's OpenAI-compatible server, separate layouts), ``hf_engine.HFEngine`` (transformers,
the reference the tests check the others against). Which one a run uses is
``rollout.engine``: a short name or the path of any class or factory that builds one
(``rollout/factory.py``).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional, Protocol

import torch

from atlas_lightning.rollout.digest import WeightDigest


class EngineError(RuntimeError):
    """An engine failed in a way a retry did not mend; the message names the engine and request."""


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling for one request. ``temperature == 0`` means greedy."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: Optional[int] = None
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingSpec


@dataclass
class GenerationResult:
    """A finished request. ``logprobs[i]`` is the engine's log-prob of ``token_ids[i]`` under the
    distribution it sampled from (temperature applied)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    #: ``stop`` (a stop token, which is included in ``token_ids``) or ``length``; from
    #: ``Engine.interrupt``, ``interrupted`` (what was generated before the cut).
    finish_reason: str
    #: Set instead of tokens when the engine failed this request.
    error: Optional[str] = None
    #: Seconds from the request's start to its first token, where the engine streams (else None).
    first_token_s: Optional[float] = None


@dataclass(frozen=True)
class AdapterVersion:
    """A LoRA adapter as a PEFT folder, with a version that grows with every sync."""

    folder: str
    version: int
    name: str = "actor"


@dataclass
class SyncReport:
    """What an engine reports holding after a weight or adapter sync, exactly (``digest.py``).

    ``digest``: per-tensor fingerprint (``digest.tensor_digest``) of what the engine holds (or received; ``held`` says which);
    ``form``: how the trainer computes the same digest of what it sent: ``{"kind": "lora",
    "dtype": "float32" | None, "scale_b": bool}`` (``digest.lora_digest``), ``{"kind":
    "tensors"}`` (``digest.digest_named`` over HF names), ``{"kind": "buckets"}`` (one
    ``digest.bucket_digest`` per bucket, named ``bucket<i>``) or ``{"kind": "unverified"}``
    (buckets whose receipt nothing reports back, e.g. nccl: only the count is compared)."""

    tensor_count: int
    digest: Optional[WeightDigest] = None
    held: str = "held by the engine"
    form: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)


class MergedWeights(Protocol):
    """The actor merged into the base, as one weight sync offers it (``rollout/sync.py``): in
    buckets of a bounded size, in one of two forms. An engine reads exactly one of them, once,
    to the end (``Engine.load_merged``); the sync digests what was read."""

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named tensors, bucket by bucket (memory stays at one bucket)."""

    def packs(self, digest: bool = True) -> Iterator[tuple[torch.Tensor, list]]:
        """Packed buckets ``(buffer, views)`` (``models.weights.merged_weight_packs``: one
        contiguous buffer, ``views`` its HF-named tensors). ``digest``: the sender records each
        bucket's digest, for an engine that reports what its workers received (False where
        nothing comes back to compare, e.g. nccl)."""


def request_seed(*parts: object) -> int:
    """A stable 31-bit seed from any parts (run seed, step, trajectory, turn)."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


class Engine(ABC):
    """A rollout engine. Not thread-safe: one agent loop drives it."""

    name: str = "engine"
    #: The size of the vocabulary the engine samples from; the agent loop refuses a token id
    #: outside it (``reply_check.py``). None: unknown (ids are then only checked >= 0).
    vocab_size: Optional[int] = None

    @abstractmethod
    def submit(self, request: GenerationRequest) -> None:
        """Queue a request; returns at once."""

    @abstractmethod
    def poll(self) -> list[GenerationResult]:
        """Advance the engine and return the requests that finished since the last call
        (possibly none). Raises ``EngineError`` when the engine itself is gone."""

    @abstractmethod
    def num_pending(self) -> int:
        """Requests submitted and not yet returned by ``poll``."""

    def abort(self, request_ids: Iterable[str]) -> None:
        """Drop requests (used on timeouts); their results never come back."""

    def interrupt(self, request_ids: Iterable[str]) -> list[GenerationResult]:
        """Stop these requests now and return what each generated so far, exactly as sampled
        (finish reason ``interrupted``; ``stop``/``length`` for one that had just finished, an
        error result for one that had failed); their results never come back from ``poll``.
        Partial rollouts need it (``rollout/interruption.py``)."""
        raise NotImplementedError(f"{self.name} cannot interrupt requests and keep their tokens "
                                  "(layout.partial_rollouts needs the vllm-server engine)")

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Submit all and wait for all; results in request order. A convenience for probes."""
        for request in requests:
            self.submit(request)
        results: dict[str, GenerationResult] = {}
        while len(results) < len(requests):
            for result in self.poll():
                results[result.request_id] = result
        return [results[r.request_id] for r in requests]

    # -- weights --------------------------------------------------------------------------

    def set_adapter(self, adapter: Optional[AdapterVersion]) -> SyncReport:
        """Serve ``adapter`` for all later requests (None: the bare base); report what is held."""
        raise NotImplementedError(f"{self.name} cannot serve LoRA adapters")

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> SyncReport:
        """Replace the base weights (HF names) in place; report what is held."""
        raise NotImplementedError(f"{self.name} cannot reload weights")

    def load_merged(self, weights: MergedWeights, version: int) -> SyncReport:
        """Serve the actor merged into the base (``weights``) as weights version ``version``;
        report what is held. How the weights arrive is the engine's: by default a stream of
        HF-named tensors through ``load_weights``; an engine whose weights arrive otherwise (a
        shared server: packed buckets through vLLM's weight transfer,
        ``separate.SharedServerEngine``) overrides it. It reads ``weights`` once, to the end.
        Collective where the engine is shared by the training ranks."""
        return self.load_weights(weights.tensors())

    @abstractmethod
    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """Log-prob of each token ``1..len-1`` given the ones before it (temperature 1), with
        the current weights and adapter: the probe that checks a sync."""

    # -- memory ---------------------------------------------------------------------------

    def sleep(self) -> None:
        """Free accelerator memory for the update (a no-op where the backend has no sleep)."""

    def wake_up(self) -> None:
        """Take memory back before a rollout."""

    @property
    def failure(self) -> Optional[str]:
        """Why the engine can serve no more (it died: ``engines/failure.py``), None while it can.
        A failed engine is not retried."""
        return None

    def close(self) -> None:
        """Release the engine."""
