"""Scheduling by trajectory (``layout.partial_rollouts``): AReaL's accounting in the separate layout.

The batch producer (``prefetch.RolloutProducer``) samples whole steps one after another, so the
engine idles on each step's slowest trajectory, and a weight sync rarely finds a rollout to
interrupt. ``TrajectoryProducer`` instead keeps ONE agent loop running on its thread
(``AgentLoop.serve``) and feeds it trajectories as slots free up, across step boundaries:

- **Admission.** Step ``first`` is trained on weights ``base`` and every later step one update
  later. A new trajectory starts only while the trajectories started so far (from step
  ``first`` on, this rank's) stay within ``(version - base + max_staleness + 1) x batch``, with
  ``version`` the weights the engine serves and ``batch`` this rank's trajectories a step
  (``wait``, the default); under ``drop`` the room is counted from the next step to hand over
  instead of the version. Trajectories start in step order, and at most
  ``rollout.max_in_flight`` (this rank's share) are in flight.
- **Hand-over.** A step is handed over (``take``) as soon as its own trajectories are done,
  whatever later steps are doing; its batch's ``weights_version`` is the version its first
  trajectory started with. Staleness is measured per trajectory at hand-over by the datamodule
  (the trainer's version minus the trajectory's oldest generated token's): the admission rule
  keeps it within ``max_staleness``, and a trajectory whose turns continue under newer weights
  (a sync interrupts it, ``interruption.py``) only gets fresher tokens.
- **The engine.** The thread holds ``engine_lock`` while it runs; a weight sync, a validation
  rollout or a checkpoint's cut asks for the engine through ``SyncPause.hold`` and the loop
  gives way (interrupting the requests in flight, which continue by re-prefill).
- **Lossless resume.** ``snapshot()`` (under ``SyncPause.hold``: a consistent cut at token
  boundaries) returns every opened, not yet handed-over step with all its trajectories, done or
  open, their tokens, log-probs, versions, open turn and runtime; a producer built with
  ``restored`` steps continues them instead of sampling them anew (``inflight.py``).

``waited_s[step]``: the seconds the loop had nothing in flight (waiting for weights or room)
since the previous step was completed (the engine's idle time as this client sees it). A
failure on the thread is raised again by ``take``. ``stop`` aborts the requests in flight and
drops what was sampled ahead (a resumed run continues from the last checkpoint's cut).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Protocol

from atlas_lightning.errors import InputError
from atlas_lightning.rollout.agent_loop import AgentLoop, LoopStats, Sampling, Trajectory
from atlas_lightning.rollout.interruption import SyncPause
from atlas_lightning.rollout.prefetch import STALENESS_POLICIES, WeightsClock

log = logging.getLogger(__name__)

#: How long the loop waits, with nothing admitted, before looking again (seconds).
IDLE_POLL_S = 0.02


class StepSource(Protocol):
    """What the producer samples from (``RolloutDataModule``)."""

    sampling: Sampling

    def train_trajectories(self, step: int) -> list[Trajectory]: ...

    def agent_loop(self, pause: Optional[SyncPause]) -> AgentLoop: ...

    def assemble_step(self, step: int, trajectories: list[Trajectory], stats: LoopStats, version: Optional[int],
                      timing: dict): ...


@dataclass
class OpenStep:
    """One step's trajectories from its opening to its hand-over (``snapshot`` saves these)."""

    step: int
    trajectories: list[Trajectory]
    version: Optional[int]
    opened: float = field(default_factory=time.monotonic)
    left: int = 0
    stats_at_open: tuple = (0, 0, 0, 0.0)


class TrajectoryProducer:
    """Samples steps ``first .. last`` trajectory by trajectory (module doc); the interface of
    ``prefetch.RolloutProducer`` (``start``, ``take``, ``stop``, ``waited_s``, ``rollbacks``)."""

    def __init__(self, source: StepSource, clock: WeightsClock, pause: SyncPause, *, first: int, last: int,
                 max_staleness: int, base_version: Optional[int] = None, policy: str = "wait",
                 restored: Optional[dict[int, OpenStep]] = None) -> None:
        if max_staleness < 0:
            raise ValueError(f"layout.max_staleness={max_staleness} must be >= 0")
        if policy not in STALENESS_POLICIES:
            raise ValueError(f"layout.staleness_policy={policy!r} is not one of {', '.join(STALENESS_POLICIES)}")
        self.source, self.clock, self.pause, self.policy = source, clock, pause, policy
        self.first, self.last, self.max_staleness = first, last, max_staleness
        self.base = first - 1 if base_version is None else base_version
        self.rollbacks = clock.rollbacks
        self.waited_s: dict[int, float] = {}
        self.restored = dict(restored or {})
        self.batch: Optional[int] = None  # this rank's trajectories a step
        self.started = 0  # trajectories admitted since step ``first``
        self.loop: Optional[AgentLoop] = None
        self._open: dict[int, OpenStep] = {}
        self._of: dict[int, int] = {}  # id(trajectory) -> its step
        self._pending: collections.deque = collections.deque()
        self._next_open = first
        self._next_take = first
        self._idle = 0.0
        self._ready: dict[int, object] = {}
        self._failure: Optional[BaseException] = None
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trajectory-producer", daemon=True)

    # -- the thread -----------------------------------------------------------------------

    def start(self) -> "TrajectoryProducer":
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            with self.pause.lock:
                self.loop = self.source.agent_loop(self.pause)
                self.loop.serve(self, self.source.sampling)
        except BaseException as err:  # handed to the trainer's thread by take()
            with self._cond:
                self._failure = err
                self._cond.notify_all()

    def capacity(self, version: Optional[int]) -> int:
        """How many trajectories may have started from step ``first`` on (module doc)."""
        if version is None:
            return 0
        lead = (version - self.base) if self.policy == "wait" else (self._next_take - self.first)
        steps = max(lead + self.max_staleness + 1, 0)
        return steps * (self.batch if self.batch is not None else 1)  # the first opening sets ``batch``

    # -- the feed (``AgentLoop.serve`` calls these on the thread) ---------------------------

    def admit(self, room: int) -> list[Trajectory]:
        out: list[Trajectory] = []
        version = self.clock.version
        while room > 0 and not self._stop.is_set() and self.started < self.capacity(version):
            if not self._pending and not self._open_next(version):
                break
            traj = self._pending.popleft()
            self.started += 1
            if traj.done:  # restored already finished
                self.ended(traj)
                continue
            out.append(traj)
            room -= 1
        return out

    def _open_next(self, version: Optional[int]) -> bool:
        step = self._next_open
        if step > self.last:
            return False
        restored = self.restored.pop(step, None)
        trajectories = self._mine(step, restored)
        if self.batch is None:
            self.batch = len(trajectories)
        elif len(trajectories) != self.batch:
            raise RuntimeError(f"step {step} has {len(trajectories)} trajectories on this rank, step {self.first} "
                               f"had {self.batch}: scheduling by trajectory needs the same number every step")
        stats = self.loop.stats if self.loop is not None else LoopStats()
        self._open[step] = OpenStep(step, trajectories, restored.version if restored is not None else version,
                                    left=len(trajectories), stats_at_open=_counters(stats, self.loop))
        for traj in trajectories:
            self._of[id(traj)] = step
        self._pending.extend(trajectories)
        self._next_open = step + 1
        if not trajectories:
            self._complete(self._open[step])
        return bool(trajectories)

    def _mine(self, step: int, restored: Optional[OpenStep]) -> list[Trajectory]:
        """This rank's trajectories of ``step``: fresh, or where a checkpoint kept them (every
        rank's, merged), the kept ones (matched by uid and session). A kept step holds every
        trajectory of its step, so a fresh one it lacks means the step's prompts changed since
        the checkpoint (the run's start-up refuses that, ``inflight.check_continued``): ``InputError``."""
        fresh = self.source.train_trajectories(step)
        if restored is None:
            return fresh
        kept = {(t.uid, t.session_id): t for t in restored.trajectories}
        unkept = [f"{t.uid}/{t.session_id}" for t in fresh if (t.uid, t.session_id) not in kept]
        if unkept:
            raise InputError(f"step {step} in flight: the checkpoint keeps no trajectory {', '.join(unkept[:3])} of "
                             f"this run's step (rollout.n, data.* or data.seed changed since it was written); resume "
                             f"with that launch's settings, or start afresh from its adapters with trainer.init_from")
        return [kept[(t.uid, t.session_id)] for t in fresh]

    def ended(self, traj: Trajectory) -> None:
        opened = self._open[self._of[id(traj)]]
        opened.left -= 1
        if opened.left == 0:
            self._complete(opened)

    def exhausted(self) -> bool:
        return self._next_open > self.last and not self._pending

    def stopping(self) -> bool:
        return self._stop.is_set()

    def idle(self) -> None:
        started = time.monotonic()
        self._stop.wait(IDLE_POLL_S)
        self._idle += time.monotonic() - started

    def _complete(self, opened: OpenStep) -> None:
        """Every trajectory of ``opened`` is done: its batch, ready to hand over."""
        requests, retries, reprefill_tokens, reprefill_s = (
            now - then for now, then in zip(_counters(self.loop.stats, self.loop), opened.stats_at_open))
        generated = sum(sum(t.response_mask) for t in opened.trajectories)
        seconds = time.monotonic() - opened.opened
        stats = LoopStats(trajectories=len(opened.trajectories), generated_tokens=generated,
                          tool_tokens=sum(len(t.response_mask) for t in opened.trajectories) - generated,
                          requests=requests, retries=retries, seconds=seconds, reprefill_tokens=reprefill_tokens)
        timing = {"gen": seconds, "reprefill": reprefill_s}
        batch = self.source.assemble_step(opened.step, opened.trajectories, stats, opened.version, timing)
        with self._cond:
            self.waited_s[opened.step], self._idle = self._idle, 0.0
            self._ready[opened.step] = batch
            self._cond.notify_all()

    # -- the trainer's side ---------------------------------------------------------------

    def take(self, step: int, poll_s: float = 1.0):
        """Step ``step``'s batch (steps are taken in order); re-raises a producer failure."""
        if step != self._next_take:
            raise RuntimeError(f"rollout producer: step {step} asked for, step {self._next_take} is next")
        with self._cond:
            while step not in self._ready:
                if self._failure is not None:
                    raise self._failure
                if not self._thread.is_alive():
                    raise RuntimeError(f"rollout producer ended before step {step} (stopped, or steps "
                                       f"{self.first}..{self.last} exhausted)")
                self._cond.wait(timeout=poll_s)
            batch = self._ready.pop(step)
            opened = self._open.pop(step)
        for traj in opened.trajectories:
            self._of.pop(id(traj), None)
        self._next_take = step + 1
        return batch

    def snapshot(self) -> list[OpenStep]:
        """The steps opened and not handed over, each with all its trajectories (module doc).
        Call it while holding the engine through ``SyncPause.hold``: the loop is then paused
        between tokens, and nothing changes under the copy."""
        if self._thread.is_alive() and not self.pause.requested():
            raise RuntimeError("TrajectoryProducer.snapshot: hold the engine (SyncPause.hold) first")
        opened = sorted(self._open.values(), key=lambda o: o.step)
        kept = [OpenStep(s, self._mine(s, self.restored[s]), self.restored[s].version) for s in sorted(self.restored)]
        return opened + kept

    def stop(self, timeout_s: Optional[float] = None) -> None:
        """Abort the requests in flight, end the thread and drop what was sampled ahead."""
        self._stop.set()
        self.clock.wake()
        if self._thread.is_alive() and timeout_s != 0:
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():
                log.warning("trajectory producer still running after %s s", timeout_s)
        with self._cond:
            self._ready.clear()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def _counters(stats: LoopStats, loop: Optional[AgentLoop]) -> tuple:
    """The loop's running counters a step's figures are differences of."""
    reprefill = loop.reprefill if loop is not None else None
    return (stats.requests, stats.retries, reprefill.tokens if reprefill else 0,
            reprefill.seconds if reprefill else 0.0)
