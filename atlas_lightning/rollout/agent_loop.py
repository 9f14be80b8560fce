"""The agent loop: many episodes' turns through one engine, with continuous batching.

Each episode alternates: the engine generates one assistant turn from the episode's tokens so
far; the runtime (``atlas_lightning.env``) reads the turn's text and answers with a tool
response or ends the episode; the answer's tokens are appended with response mask 0. Turns of
different episodes interleave: as soon as one turn finishes, that episode's next turn is
submitted (up to ``max_in_flight`` requests at once).

Token contract, per trajectory (``Trajectory``):
- ``prompt_ids``: the chat-template prompt (system + user + assistant header).
- ``response_ids``: every token after the prompt: generated turns exactly as the engine
  produced them, and tool-response tokens in between.
- ``response_mask``: 1 on generated tokens, 0 on tool-response tokens.
- ``response_logprobs``: the engine's log-prob of each generated token (the behaviour policy's);
  0.0 on mask-0 tokens.
- ``response_versions``: the weights version that generated each token, as ``policy_version()``
  read when its request was (re)submitted; -1 on mask-0 tokens and where no version is known.
  A request is never in flight across a weight change (the weight sync holds the engine), so
  the version read at submission is the one that sampled the tokens.

Limits (``config.LoopLimits``: the ``rollout`` keys the loop obeys): a turn may generate at
most ``max_tokens_per_turn`` tokens and never more than the response budget
(``max_response_length``) or the context (``max_model_len``) leaves; running out ends the
episode with ``response_length`` or ``context_overflow``.

Faults: a request that errs or outlives ``request_timeout_s`` is resubmitted with the same seed
up to ``max_retries`` times; beyond that, or when the engine itself fails more than
``max_retries`` times in a row, ``EngineError`` names the trajectories that did not finish and
no partial batch is returned.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from atlas_lightning.config import LoopLimits
from atlas_lightning.rollout.chat import ChatFormat
from atlas_lightning.rollout.engine import (
    Engine,
    EngineError,
    GenerationRequest,
    GenerationResult,
    SamplingSpec,
    request_seed,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1


@dataclass
class Trajectory:
    """One episode's tokens and its runtime. ``uid`` is shared by the samples of a question."""

    uid: str
    session_id: str
    episode: object  # atlas_lightning.env.Episode
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    response_versions: list[int] = field(default_factory=list)
    attempt_id: int = 0
    turns: int = 0
    gen_seconds: float = 0.0

    @property
    def done(self) -> bool:
        return bool(self.episode.done)


@dataclass
class LoopStats:
    trajectories: int = 0
    generated_tokens: int = 0
    tool_tokens: int = 0
    requests: int = 0
    retries: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


ProgressFn = Callable[[int, int, LoopStats], None]
#: ``policy_version()``: the weights version the engine serves now (None: unknown).
VersionFn = Callable[[], Optional[int]]
#: The version a token carries when none is known, and on tool-response tokens.
NO_VERSION = -1


class AgentLoop:
    """Runs episodes to completion on one engine. Stateless between calls. ``policy_version``:
    the engine's weights version, stamped on each generated token (``response_versions``)."""

    def __init__(self, engine: Engine, chat: ChatFormat, limits: LoopLimits,
                 policy_version: Optional[VersionFn] = None) -> None:
        self.engine = engine
        self.chat = chat
        self.limits = limits
        self.policy_version = policy_version or (lambda: None)

    def run(
        self,
        trajectories: list[Trajectory],
        sampling: Sampling,
        seed_parts: tuple = (),
        progress: Optional[ProgressFn] = None,
    ) -> LoopStats:
        """Drive every trajectory to a terminal state, in place. ``seed_parts`` (e.g. run seed
        and step) and the trajectory's ids and turn make each request's sampling seed."""
        limits = self.limits
        stats = LoopStats(trajectories=len(trajectories))
        started = time.monotonic()
        waiting = [t for t in trajectories if not t.done]  # ready for their next turn
        in_flight: dict[str, tuple[Trajectory, GenerationRequest, float]] = {}
        versions: dict[str, Optional[int]] = {}  # the weights version each request was sent to
        engine_failures = 0
        done = len(trajectories) - len(waiting)

        def send(traj: Trajectory, request: GenerationRequest) -> None:
            versions[request.request_id] = self.policy_version()
            self.engine.submit(request)
            in_flight[request.request_id] = (traj, request, time.monotonic())

        def submit(traj: Trajectory) -> None:
            request = self._next_request(traj, sampling, seed_parts)
            if request is None:
                return
            send(traj, request)
            stats.requests += 1

        while waiting or in_flight:
            while waiting and len(in_flight) < limits.max_in_flight:
                traj = waiting.pop(0)
                submit(traj)
                if traj.done:  # ended before generating (budget spent)
                    done += 1
            if not in_flight:
                continue
            try:
                results = self.engine.poll()
                engine_failures = 0
            except EngineError as err:
                engine_failures += 1
                if engine_failures > limits.max_retries:
                    raise EngineError(
                        f"{self.engine.name} engine failed {engine_failures} times in a row; "
                        f"{len(in_flight) + len(waiting)} trajectories unfinished "
                        f"(e.g. {self._names(in_flight, waiting)}); the step is not recorded: {err}"
                    ) from err
                stats.retries += 1
                log.warning("%s engine failed (%d in a row, %d requests in flight); retrying: %s",
                            self.engine.name, engine_failures, len(in_flight), err)
                time.sleep(min(2.0 ** engine_failures, 30.0))
                continue
            for result in results:
                entry = in_flight.pop(result.request_id, None)
                if entry is None:
                    continue  # an aborted request's late result
                traj, request, sent = entry
                if result.error is not None:
                    self._retry(traj, request, result.error, stats)
                    send(traj, request)
                    continue
                traj.gen_seconds += time.monotonic() - sent
                self._apply_turn(traj, request, result, stats, versions.pop(request.request_id))
                if traj.done:
                    done += 1
                    if progress:
                        stats.seconds = time.monotonic() - started
                        progress(done, len(trajectories), stats)
                else:
                    waiting.append(traj)
            for traj, request in self._expire(in_flight, stats):
                send(traj, request)
        stats.seconds = time.monotonic() - started
        return stats

    # -- one turn -------------------------------------------------------------------------

    def _next_request(self, traj: Trajectory, sampling: Sampling, seed_parts: tuple) -> Optional[GenerationRequest]:
        limits = self.limits
        used = len(traj.response_ids)
        context_left = limits.max_model_len - len(traj.prompt_ids) - used
        response_left = limits.max_response_length - used
        if context_left <= 0 or response_left <= 0:
            reason = "context_overflow" if context_left <= 0 and context_left < response_left else "response_length"
            traj.episode.stop(reason, self._last_generated(traj))
            return None
        max_tokens = min(limits.max_tokens_per_turn, response_left, context_left)
        seed = request_seed(*seed_parts, traj.uid, traj.session_id, traj.turns, traj.attempt_id)
        return GenerationRequest(
            request_id=f"{traj.uid}/{traj.session_id}/t{traj.turns}/a{traj.attempt_id}",
            prompt_ids=tuple(traj.prompt_ids + traj.response_ids),
            sampling=SamplingSpec(
                max_tokens=max_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                seed=seed,
                stop_token_ids=self.chat.stop_token_ids,
            ),
        )

    def _apply_turn(self, traj: Trajectory, request: GenerationRequest, result: GenerationResult, stats: LoopStats,
                    version: Optional[int] = None) -> None:
        limits = self.limits
        start = len(traj.response_ids)
        traj.response_ids.extend(result.token_ids)
        traj.response_mask.extend([1] * len(result.token_ids))
        traj.response_logprobs.extend(result.logprobs)
        traj.response_versions.extend([NO_VERSION if version is None else int(version)] * len(result.token_ids))
        traj.turns += 1
        stats.generated_tokens += len(result.token_ids)
        end = len(traj.response_ids)
        if not result.token_ids:
            traj.episode.stop("response_length", self._last_generated(traj))
            return
        cut_by_budget = result.finish_reason == "length" and request.sampling.max_tokens < limits.max_tokens_per_turn
        if cut_by_budget:
            context_left = limits.max_model_len - len(traj.prompt_ids) - end
            response_left = limits.max_response_length - end
            reason = "context_overflow" if context_left <= 0 and context_left < response_left else "response_length"
            # recorded as a truncated generation (never executed), so that the episode's token
            # counts cover every token the record's arrays hold
            traj.episode.stop(reason, end - 1, text=self.chat.decode_turn(result.token_ids), start=start)
            return
        reply = traj.episode.on_assistant_turn(self.chat.decode_turn(result.token_ids), start, end)
        if reply is None or traj.episode.done:
            return
        closed = result.token_ids[-1] in self.chat.stop_token_ids
        tool_ids = self.chat.tool_response_ids(reply, turn_closed=closed)
        new_len = end + len(tool_ids)
        if len(traj.prompt_ids) + new_len >= limits.max_model_len:
            traj.episode.stop("context_overflow", end - 1)
            return
        if new_len >= limits.max_response_length:
            traj.episode.stop("response_length", end - 1)
            return
        traj.response_ids.extend(tool_ids)
        traj.response_mask.extend([0] * len(tool_ids))
        traj.response_logprobs.extend([0.0] * len(tool_ids))
        traj.response_versions.extend([NO_VERSION] * len(tool_ids))
        traj.episode.on_tool_response_tokens(end, new_len)
        stats.tool_tokens += len(tool_ids)

    @staticmethod
    def _last_generated(traj: Trajectory) -> Optional[int]:
        for pos in range(len(traj.response_mask) - 1, -1, -1):
            if traj.response_mask[pos]:
                return pos
        return None

    # -- faults ---------------------------------------------------------------------------

    def _retry(self, traj: Trajectory, request: GenerationRequest, why: str, stats: LoopStats) -> None:
        traj.attempt_id += 1
        stats.retries += 1
        log.warning("request %s: %s; attempt %d of %d", request.request_id, why, traj.attempt_id + 1,
                    self.limits.max_retries + 1)
        if traj.attempt_id > self.limits.max_retries:
            raise EngineError(
                f"{self.engine.name} engine: request {request.request_id} failed {traj.attempt_id} times "
                f"(last: {why}); the step is not recorded"
            )

    def _expire(self, in_flight: dict, stats: LoopStats) -> list[tuple[Trajectory, GenerationRequest]]:
        """Abort the requests in flight longer than ``request_timeout_s``; returns them, to be
        sent again (with the same seed)."""
        now = time.monotonic()
        expired = [rid for rid, (_, _, sent) in in_flight.items() if now - sent > self.limits.request_timeout_s]
        if not expired:
            return []
        self.engine.abort(expired)
        again = []
        for rid in expired:
            traj, request, _ = in_flight.pop(rid)
            self._retry(traj, request, f"timed out after {self.limits.request_timeout_s:.0f} s", stats)
            again.append((traj, request))
        return again

    @staticmethod
    def _names(in_flight: dict, waiting: list) -> str:
        names = [f"{t.uid}/{t.session_id}" for t, _, _ in list(in_flight.values())[:3]]
        names += [f"{t.uid}/{t.session_id}" for t in waiting[: max(0, 3 - len(names))]]
        return ", ".join(names)
