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
  A request is never in flight across a weight change (the weight sync holds the engine, or,
  with partial rollouts, interrupts it first), so the version read at submission is the one
  that sampled the tokens.

Partial rollouts (``pause`` given, ``rollout/interruption.py``): when a weight sync asks for
the engine, every request in flight is interrupted (``Engine.interrupt``) and what it generated
is appended to its trajectory at once, as any generated tokens (mask 1, log-probs, the version
it was sent to); no tool call is parsed from half a turn. After the sync the open turn is sent
again with everything so far as its prompt (re-prefilled under the new weights), the rest of
the turn's token budget, and a seed of its own (the turn's seed parts and ``s<segment>``). When
the turn ends, the runtime reads it whole: a turn may carry two versions, and its tokens are
concatenated as generated, never decoded and re-encoded.

Limits (``config.LoopLimits``: the ``rollout`` keys the loop obeys): a turn may generate at
most ``max_tokens_per_turn`` tokens and never more than the response budget
(``max_response_length``) or the context (``max_model_len``) leaves; running out ends the
episode with ``response_length`` or ``context_overflow``.

Faults: every engine's reply is checked as it enters the loop (``reply_check.py``: a log-prob
per token, finite and <= 0, ids in the vocabulary, no more tokens than asked); one that is not
so is a failed request. A request that errs or outlives ``request_timeout_s`` is resubmitted with the same seed
up to ``max_retries`` times; beyond that, or when the engine itself fails more than
``max_retries`` times in a row, ``EngineError`` names the trajectories that did not finish and
no partial batch is returned.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

from atlas_lightning.config import LoopLimits
from atlas_lightning.rollout.chat import ChatFormat
from atlas_lightning.rollout.interruption import ReprefillMeter, SyncPause
from atlas_lightning.rollout.reply_check import checked
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
    #: Partial rollouts: tokens of the turn in progress already generated (and appended) before
    #: interruptions, and how many times that turn was interrupted (its continuations' seeds).
    open_turn: int = 0
    segment: int = 0
    #: The seed parts of its requests (e.g. run seed, "train", its RL step) where one loop drives
    #: trajectories of several steps (scheduling by trajectory); None: the run's ``seed_parts``.
    seed_parts: Optional[tuple] = None

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
    #: Partial rollouts: tokens prefilled again to continue interrupted turns (None: not on).
    reprefill_tokens: Optional[int] = None

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


ProgressFn = Callable[[int, int, LoopStats], None]


@dataclass
class Lane:
    """One group of trajectories in a shared ``AgentLoop.run_lanes``: its own sampling, seed
    parts, progress and ``LoopStats`` (``stats.seconds``: from the run's start to its last
    trajectory's end). ``tag`` prefixes its request ids (the lanes of one run never share one).
    Lanes share the engine (continuous batching); the first lane's requests are queued first."""

    trajectories: list
    sampling: Sampling
    seed_parts: tuple = ()
    progress: Optional[ProgressFn] = None
    tag: str = ""
    stats: LoopStats = field(default_factory=LoopStats)
    done: int = 0
    ended_at: Optional[float] = None
#: ``policy_version()``: the weights version the engine serves now (None: unknown).
VersionFn = Callable[[], Optional[int]]
#: The version a token carries when none is known, and on tool-response tokens.
NO_VERSION = -1


class Feed(Protocol):
    """What ``AgentLoop.serve`` drives (``rollout/trajectory_producer.py``): ``admit(room)``, up to
    ``room`` new trajectories that may start now; ``ended(traj)``, one of them ended;
    ``exhausted()``, nothing more will be admitted; ``stopping()``, leave now; ``idle()``, nothing
    to do: wait a moment (for new weights or room)."""

    def admit(self, room: int) -> list[Trajectory]: ...

    def ended(self, traj: Trajectory) -> None: ...

    def exhausted(self) -> bool: ...

    def stopping(self) -> bool: ...

    def idle(self) -> None: ...


@dataclass
class _Run:
    """One ``AgentLoop.run_lanes``' moving parts: its lanes (and each trajectory's, by ``id``),
    trajectories waiting for their next request, the requests in flight (trajectory, request,
    when sent) and the weights version each was sent to, the interruption each continuation
    resumes (partial rollouts)."""

    lanes: list
    lane_of: dict
    waiting: list
    in_flight: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    resumes: dict = field(default_factory=dict)
    engine_failures: int = 0
    started: float = field(default_factory=time.monotonic)
    #: What admits trajectories and hears of each that ends (``AgentLoop.serve``); None in ``run``.
    feed: Optional["Feed"] = None

    def lane(self, traj: Trajectory) -> Lane:
        return self.lane_of[id(traj)]

    def ended(self, traj: Trajectory) -> None:
        """``traj`` reached its terminal state: its lane counts it and hears of it."""
        lane = self.lane(traj)
        lane.done += 1
        lane.ended_at = time.monotonic()
        if lane.progress:
            lane.stats.seconds = lane.ended_at - self.started
            lane.progress(lane.done, lane.stats.trajectories, lane.stats)
        if self.feed is not None:
            self.feed.ended(traj)


class AgentLoop:
    """Runs episodes to completion on one engine. Stateless between calls. ``policy_version``:
    the engine's weights version, stamped on each generated token (``response_versions``).
    ``pause`` (partial rollouts, ``rollout/interruption.py``): a weight sync that wants the
    engine interrupts the requests in flight, which continue under the new weights."""

    def __init__(self, engine: Engine, chat: ChatFormat, limits: LoopLimits,
                 policy_version: Optional[VersionFn] = None, pause: Optional[SyncPause] = None) -> None:
        self.engine = engine
        self.chat = chat
        self.limits = limits
        self.policy_version = policy_version or (lambda: None)
        self.pause = pause
        #: What interruptions cost the last ``run`` (partial rollouts).
        self.reprefill = ReprefillMeter()

    def run(
        self,
        trajectories: list[Trajectory],
        sampling: Sampling,
        seed_parts: tuple = (),
        progress: Optional[ProgressFn] = None,
    ) -> LoopStats:
        """Drive every trajectory to a terminal state, in place. ``seed_parts`` (e.g. run seed
        and step) and the trajectory's ids and turn make each request's sampling seed."""
        return self.run_lanes([Lane(trajectories, sampling, seed_parts, progress)])[0]

    def serve(self, feed: "Feed", sampling: Sampling) -> LoopStats:
        """Drive trajectories as ``feed`` admits them, without draining between admissions, until
        ``feed.exhausted()`` with nothing in flight, or ``feed.stopping()`` (then the requests in
        flight are aborted and forgotten). Every admitted trajectory that ends is passed to
        ``feed.ended``. Each trajectory carries its own ``seed_parts``. The loop's running
        figures are ``self.stats`` (read them between ``feed`` calls, on the loop's thread)."""
        return self.run_lanes([Lane([], sampling)], feed=feed)[0]

    def run_lanes(self, lanes: list[Lane], feed: Optional["Feed"] = None) -> list[LoopStats]:
        """``run`` for several lanes at once, on the same engine (``Lane``); each lane's stats.
        A request's seed and tokens depend on its lane's seed parts, never on the other lanes.
        ``feed`` (``serve``): admits more trajectories into the first lane as room allows."""
        limits = self.limits
        self.reprefill = ReprefillMeter()
        tags = [lane.tag for lane in lanes]
        if len(set(tags)) < len(tags):
            raise ValueError(f"AgentLoop.run_lanes: lanes need distinct tags, got {tags}")
        run = _Run(lanes, {id(t): lane for lane in lanes for t in lane.trajectories}, [], feed=feed)
        for lane in lanes:
            lane.stats = LoopStats(trajectories=len(lane.trajectories))
            ready = [t for t in lane.trajectories if not t.done]  # ready for their next turn
            lane.done = len(lane.trajectories) - len(ready)
            run.waiting += ready
        self.stats = lanes[0].stats
        while run.waiting or run.in_flight or (feed is not None and not feed.exhausted()):
            if feed is not None:
                if feed.stopping():
                    self.engine.abort(list(run.in_flight))
                    break
                self._admit(run, feed.admit(limits.max_in_flight - len(run.in_flight) - len(run.waiting)))
            while run.waiting and len(run.in_flight) < limits.max_in_flight:
                traj = run.waiting.pop(0)
                self._submit(run, traj)
                if traj.done:  # ended before generating (budget spent)
                    run.ended(traj)
            if self.pause is not None and self.pause.requested() and (run.in_flight or feed is not None):
                self._give_way(run)  # then the open turns are sent again, first
                continue
            if not run.in_flight:
                if feed is not None and not run.waiting:
                    feed.idle()  # nothing admitted yet: wait for new weights or room
                continue
            for result in self._poll(run):
                entry = run.in_flight.pop(result.request_id, None)
                if entry is None:
                    continue  # an aborted request's late result
                traj, request, sent = entry
                result = self._checked(request, result)
                if result.error is not None:
                    self._retry(traj, request, result.error, run.lane(traj).stats)
                    self._send(run, traj, request)
                    continue
                self._finish_turn(run, traj, request, result, sent)
            for traj, request in self._expire(run):
                self._send(run, traj, request)
        now = time.monotonic()
        for lane in lanes:
            lane.stats.seconds = (lane.ended_at if len(lanes) > 1 and lane.ended_at else now) - run.started
        return [lane.stats for lane in lanes]

    def _admit(self, run: _Run, trajectories: list[Trajectory]) -> None:
        """``serve``'s feed admitted ``trajectories``: they join the first lane and wait."""
        lane = run.lanes[0]
        for traj in trajectories:
            run.lane_of[id(traj)] = lane
            lane.stats.trajectories += 1
        run.waiting.extend(trajectories)

    # -- requests -------------------------------------------------------------------------

    def _send(self, run: _Run, traj: Trajectory, request: GenerationRequest) -> None:
        run.versions[request.request_id] = self.policy_version()
        self.engine.submit(request)
        run.in_flight[request.request_id] = (traj, request, time.monotonic())

    def _submit(self, run: _Run, traj: Trajectory) -> None:
        lane = run.lane(traj)
        request = self._next_request(traj, lane.sampling, lane.seed_parts, lane.tag)
        if request is None:
            return
        if traj.segment:  # an interrupted turn's continuation: its prefix is prefilled again
            if not self.reprefill.interruptions:  # cut before this run began (kept by a checkpoint): that cut
                self.reprefill.resumed()          # counts as this run's first interruption
            self.reprefill.continued(len(request.prompt_ids))
            run.resumes[request.request_id] = self.reprefill.interruptions - 1
        self._send(run, traj, request)
        lane.stats.requests += 1

    def _poll(self, run: _Run) -> list[GenerationResult]:
        """The engine's finished results; an engine failure is retried after a back-off, up to
        ``max_retries`` in a row (then ``EngineError``)."""
        try:
            results = self.engine.poll()
            run.engine_failures = 0
            return results
        except EngineError as err:
            run.engine_failures += 1
            # a dead engine (``Engine.failure``) answers no retry: stop now, not after the back-offs
            if run.engine_failures > self.limits.max_retries or getattr(self.engine, "failure", None) is not None:
                raise EngineError(
                    f"{self.engine.name} engine failed {run.engine_failures} time{'s' if run.engine_failures > 1 else ''} in a row; "
                    f"{len(run.in_flight) + len(run.waiting)} trajectories unfinished "
                    f"(e.g. {self._names(run.in_flight, run.waiting)}); the step is not recorded: {err}"
                ) from err
            run.lanes[0].stats.retries += 1
            log.warning("%s engine failed (%d in a row, %d requests in flight); retrying: %s",
                        self.engine.name, run.engine_failures, len(run.in_flight), err)
            time.sleep(min(2.0 ** run.engine_failures, 30.0))
            return []

    def _checked(self, request: GenerationRequest, result: GenerationResult) -> GenerationResult:
        """Every engine's result as it enters the loop, checked (``reply_check``): a reply that
        cannot be ``request``'s becomes an error result, retried as any failed request."""
        return checked(request, result, self.engine.name, getattr(self.engine, "vocab_size", None))

    def _finish_turn(self, run: _Run, traj: Trajectory, request: GenerationRequest, result: GenerationResult,
                     sent: float) -> None:
        traj.gen_seconds += time.monotonic() - sent
        resumed = run.resumes.pop(request.request_id, None)
        if resumed is not None and result.first_token_s is not None:
            self.reprefill.first_token(resumed, sent + result.first_token_s)
        self._apply_turn(traj, request, result, run.lane(traj).stats, run.versions.pop(request.request_id))
        if traj.done:
            run.ended(traj)
        else:
            run.waiting.append(traj)

    def _give_way(self, run: _Run) -> None:
        """A weight sync wants the engine: interrupt every request in flight, keep what each
        generated (its open turn grows; version: the one it was sent to), give the engine up
        until the sync is over, then queue the open turns first, to be continued by re-prefill."""
        interrupted = run.in_flight
        run.in_flight = {}
        results = {r.request_id: r for r in self.engine.interrupt(list(interrupted))} if interrupted else {}
        resend, resume = [], []
        for rid, (traj, request, sent) in interrupted.items():
            result = self._checked(request, results[rid])
            if result.error is not None:
                self._retry(traj, request, result.error, run.lane(traj).stats)
                resend.append((traj, request))
            elif result.finish_reason == "interrupted":
                self._keep_partial(run, traj, request, result, sent)
                resume.append(traj)
            else:  # it finished before the cut
                self._finish_turn(run, traj, request, result, sent)
        self.pause.give_way()
        if resume:
            self.reprefill.resumed()
        run.waiting[:0] = resume
        for traj, request in resend:
            self._send(run, traj, request)

    def _keep_partial(self, run: _Run, traj: Trajectory, request: GenerationRequest, result: GenerationResult,
                      sent: float) -> None:
        """An interrupted request's tokens join its trajectory's open turn, as generated."""
        version = run.versions.pop(request.request_id)
        run.resumes.pop(request.request_id, None)
        traj.gen_seconds += time.monotonic() - sent
        _append_generated(traj, result, version)
        traj.open_turn += len(result.token_ids)
        traj.segment += 1
        run.lane(traj).stats.generated_tokens += len(result.token_ids)

    # -- one turn -------------------------------------------------------------------------

    def _next_request(self, traj: Trajectory, sampling: Sampling, seed_parts: tuple,
                      tag: str = "") -> Optional[GenerationRequest]:
        limits = self.limits
        used = len(traj.response_ids)
        context_left = limits.max_model_len - len(traj.prompt_ids) - used
        response_left = limits.max_response_length - used
        if context_left <= 0 or response_left <= 0:
            reason = "context_overflow" if context_left <= 0 and context_left < response_left else "response_length"
            traj.episode.stop(reason, self._last_generated(traj))
            return None
        # an interrupted turn continues with what is left of its own budget
        max_tokens = min(limits.max_tokens_per_turn - traj.open_turn, response_left, context_left)
        segment = (f"s{traj.segment}",) if traj.segment else ()  # a continuation samples anew
        if traj.seed_parts is not None:
            seed_parts = traj.seed_parts
        seed = request_seed(*seed_parts, traj.uid, traj.session_id, traj.turns, traj.attempt_id, *segment)
        return GenerationRequest(
            request_id=tag + "/".join((traj.uid, traj.session_id, f"t{traj.turns}", f"a{traj.attempt_id}", *segment)),
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
        start = len(traj.response_ids) - traj.open_turn  # the turn began before its interruptions
        earlier, traj.open_turn, traj.segment = traj.open_turn, 0, 0
        _append_generated(traj, result, version)
        traj.turns += 1
        stats.generated_tokens += len(result.token_ids)
        end = len(traj.response_ids)
        turn = traj.response_ids[start:]  # as generated, segments concatenated: never re-encoded
        if not turn:
            traj.episode.stop("response_length", self._last_generated(traj))
            return
        cut_by_budget = (result.finish_reason == "length"
                         and earlier + request.sampling.max_tokens < limits.max_tokens_per_turn)
        if cut_by_budget:
            context_left = limits.max_model_len - len(traj.prompt_ids) - end
            response_left = limits.max_response_length - end
            reason = "context_overflow" if context_left <= 0 and context_left < response_left else "response_length"
            # recorded as a truncated generation (never executed), so that the episode's token
            # counts cover every token the record's arrays hold
            traj.episode.stop(reason, end - 1, text=self.chat.decode_turn(turn), start=start)
            return
        reply = traj.episode.on_assistant_turn(self.chat.decode_turn(turn), start, end)
        if reply is None or traj.episode.done:
            return
        closed = turn[-1] in self.chat.stop_token_ids
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

    def _expire(self, run: _Run) -> list[tuple[Trajectory, GenerationRequest]]:
        """Abort the requests in flight longer than ``request_timeout_s``; returns them, to be
        sent again (with the same seed)."""
        in_flight = run.in_flight
        now = time.monotonic()
        expired = [rid for rid, (_, _, sent) in in_flight.items() if now - sent > self.limits.request_timeout_s]
        if not expired:
            return []
        self.engine.abort(expired)
        again = []
        for rid in expired:
            traj, request, _ = in_flight.pop(rid)
            self._retry(traj, request, f"timed out after {self.limits.request_timeout_s:.0f} s", run.lane(traj).stats)
            again.append((traj, request))
        return again

    @staticmethod
    def _names(in_flight: dict, waiting: list) -> str:
        names = [f"{t.uid}/{t.session_id}" for t, _, _ in list(in_flight.values())[:3]]
        names += [f"{t.uid}/{t.session_id}" for t in waiting[: max(0, 3 - len(names))]]
        return ", ".join(names)


def _append_generated(traj: Trajectory, result: GenerationResult, version: Optional[int]) -> None:
    """``result``'s tokens onto ``traj`` as generated: mask 1, their log-probs, ``version``."""
    traj.response_ids.extend(result.token_ids)
    traj.response_mask.extend([1] * len(result.token_ids))
    traj.response_logprobs.extend(result.logprobs)
    traj.response_versions.extend([NO_VERSION if version is None else int(version)] * len(result.token_ids))
