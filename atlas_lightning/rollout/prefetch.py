"""Asynchronous rollouts with bounded staleness (the separate layout, README, "The separate layout").

Two pieces, both thread-level (one producer thread per training process, beside Lightning's
loop; no collectives run on it):

- ``WeightsClock``: the weights version the engine serves (the number of updates applied to
  the weights it holds). The weight sync publishes each new version; the producer waits on it.
  A version lower than the last one is a NaN-guard rollback (``rollbacks`` counts them).
- ``RolloutProducer``: samples RL steps ``first .. last`` in order on a background thread,
  each with whatever version the engine serves when it starts, and hands them over in order
  (``take``). Step ``first`` is trained on weights ``base`` (``first - 1`` unless a rollback
  says otherwise) and every later step one update later, so it starts step ``s`` only when
  ``(s - first) - (version - base) <= max_staleness``: the bound on how many versions its
  rollout lags the policy it trains. With ``max_staleness = 1``, step ``k + 1`` is sampled
  with version ``k - 1`` while update ``k`` runs; with 0 nothing overlaps. After a rollback
  the datamodule starts a new producer from the restored version.

The staleness policy (``layout.staleness_policy``) says what holds a rollout within the bound:
``wait`` (the default; the rule above: the producer waits for new weights, never samples a
batch that would be too stale, and nothing is dropped) or ``drop`` (the producer waits only for
room: it starts step ``s`` once ``s - max_staleness`` is taken, whatever version the engine
serves, and the datamodule drops, at hand-over, every trajectory that has fallen more than
``max_staleness`` versions behind). ``waited_s[step]``: how long the producer waited before
sampling ``step`` (the engine's idle time, as this client sees it). With partial rollouts the
datamodule uses ``trajectory_producer.TrajectoryProducer`` instead (scheduling by trajectory,
and a resume that keeps the trajectories in flight).

The engine is shared with the weight sync and validation: every use of it holds
``engine_lock`` for its whole duration (a rollout, a sync), so a batch is sampled with exactly
one version and a sync never swaps weights under a running rollout; with partial rollouts
(``layout.partial_rollouts``, ``interruption.py``) a sync interrupts the running rollout
instead, which gives the lock up until the sync is over and then continues on the new version.

An exception on the producer thread is raised again by ``take``. ``stop`` asks the thread to
end after its current rollout and drops what it sampled ahead (a resumed run samples those
steps again from the data cursor: nothing is lost or counted twice).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Optional

log = logging.getLogger(__name__)

#: ``layout.staleness_policy`` (module doc).
STALENESS_POLICIES = ("wait", "drop")


class WeightsClock:
    """The engine's weights version, published by the weight sync, awaited by the producer."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._version: Optional[int] = None
        #: How many times a lower version was published (NaN-guard rollbacks).
        self.rollbacks = 0

    @property
    def version(self) -> Optional[int]:
        return self._version

    def publish(self, version: Optional[int]) -> None:
        with self._cond:
            if version is not None and self._version is not None and version < self._version:
                self.rollbacks += 1
            self._version = version
            self._cond.notify_all()

    def wake(self) -> None:
        """Wake every waiter to look again (the version unchanged)."""
        with self._cond:
            self._cond.notify_all()

    def wait_until(self, ready: Callable[[Optional[int]], bool], stop: threading.Event,
                   poll_s: float = 0.5) -> Optional[int]:
        """Block until ``ready(version)`` (returns the version) or ``stop`` is set (returns None)."""
        with self._cond:
            while not stop.is_set():
                if ready(self._version):
                    return self._version
                self._cond.wait(timeout=poll_s)
        return None


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class RolloutProducer:
    """Samples steps ``first .. last`` ahead of the trainer within ``max_staleness`` versions.

    ``sample(step)`` runs one step's rollout and returns its batch (it must take
    ``engine_lock`` itself, as ``RolloutDataModule.rollout`` does, and record the version it
    sampled with). ``take(step)`` returns that step's batch, blocking until it is there."""

    def __init__(self, sample: Callable[[int], object], clock: WeightsClock, *, first: int, last: int,
                 max_staleness: int, base_version: Optional[int] = None, policy: str = "wait") -> None:
        if max_staleness < 0:
            raise ValueError(f"layout.max_staleness={max_staleness} must be >= 0")
        if policy not in STALENESS_POLICIES:
            raise ValueError(f"layout.staleness_policy={policy!r} is not one of {', '.join(STALENESS_POLICIES)}")
        self.sample, self.clock, self.policy = sample, clock, policy
        #: Seconds the producer waited before sampling each step (module doc).
        self.waited_s: dict[int, float] = {}
        self.first, self.last, self.max_staleness = first, last, max_staleness
        #: The weights step ``first`` is trained on.
        self.base = first - 1 if base_version is None else base_version
        #: The clock's rollback count when this producer started (a new rollback retires it).
        self.rollbacks = clock.rollbacks
        self._ready: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self._next_take = first

    def allowed(self, step: int, version: Optional[int]) -> bool:
        """May step ``step`` be sampled now that the engine serves ``version`` (module doc)?"""
        if version is None:
            return False
        if self.policy == "drop":
            return step - self._next_take <= self.max_staleness
        return (step - self.first) - (version - self.base) <= self.max_staleness

    def start(self) -> "RolloutProducer":
        self._thread.start()
        return self

    def _run(self) -> None:
        for step in range(self.first, self.last + 1):
            started = time.monotonic()
            if self.clock.wait_until(lambda v, s=step: self.allowed(s, v), self._stop) is None:
                return
            self.waited_s[step] = time.monotonic() - started
            try:
                batch = self.sample(step)
            except BaseException as err:  # handed to the trainer's thread by take()
                self._ready.put((step, _Failed(err)))
                return
            if self._stop.is_set():
                return
            self._ready.put((step, batch))

    def take(self, step: int, poll_s: float = 1.0):
        """Step ``step``'s batch (steps are taken in order); re-raises a producer failure."""
        if step != self._next_take:
            raise RuntimeError(f"rollout producer: step {step} asked for, step {self._next_take} is next")
        while True:
            try:
                got, batch = self._ready.get(timeout=poll_s)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._ready.empty():
                    raise RuntimeError(f"rollout producer ended before step {step} (stopped, or steps "
                                       f"{self.first}..{self.last} exhausted)") from None
        if isinstance(batch, _Failed):
            raise batch.error
        if got != step:
            raise RuntimeError(f"rollout producer: got step {got}, expected {step}")
        self._next_take = step + 1
        self.clock.wake()  # room for one more step under the drop policy
        return batch

    def stop(self, timeout_s: Optional[float] = None) -> None:
        """End the thread after its current rollout and drop what was sampled ahead."""
        self._stop.set()
        self.clock.wake()
        if self._thread.is_alive() and timeout_s != 0:
            started = time.monotonic()
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():
                log.warning("rollout producer still running after %.0f s", time.monotonic() - started)
        while not self._ready.empty():
            self._ready.get_nowait()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
