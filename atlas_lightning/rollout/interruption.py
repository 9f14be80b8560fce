"""Partial rollouts (``layout.partial_rollouts``): a weight sync cuts in on a running rollout.

Without it, a rollout holds ``engine_lock`` from its first request to its last and a weight
sync waits for it (a batch is sampled with one version). With it:

- ``SyncPause.hold()`` (the weight sync's side) asks the rollout to give way, then takes
  ``engine_lock``; when the sync has published the new version and let go of the lock, the
  request is withdrawn.
- The agent loop (the rollout's side, on the producer thread) reads ``requested()`` at every
  turn of its loop; when set, it interrupts every request in flight, keeps what each produced
  (``Engine.interrupt``: tokens, log-probs, the version they were sent to) and calls
  ``give_way()``, which releases ``engine_lock`` until the sync is over, then takes it back.
  The open turns are then continued by re-prefill under the new weights (README, "Partial
  rollouts in the separate layout": why not from the old KV cache).
- ``ReprefillMeter`` counts what interruptions cost: the tokens prefilled again (prompt and
  response so far, per continued request) and, per interruption, the seconds from the
  continuations' resubmission to the last of their first tokens (the re-prefill's wall time as
  the client sees it).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator, Optional


class SyncPause:
    """Lets a weight sync interrupt the rollout that holds ``lock`` (module doc). ``lock`` is the
    datamodule's ``engine_lock`` (reentrant); the rollout must hold it exactly once when it
    calls ``give_way``."""

    def __init__(self, lock: threading.RLock) -> None:
        self.lock = lock
        self._wanted = threading.Event()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """The sync's side: the engine to itself, a running rollout interrupted to get it."""
        self._wanted.set()
        try:
            with self.lock:
                yield
        finally:
            self._wanted.clear()

    def requested(self) -> bool:
        """Whether a sync waits for the engine (the rollout should interrupt and give way)."""
        return self._wanted.is_set()

    def give_way(self, poll_s: float = 0.01) -> None:
        """The rollout's side: release the engine until the sync is over, then take it back."""
        self.lock.release()
        try:
            while self._wanted.is_set():
                time.sleep(poll_s)
        finally:
            self.lock.acquire()


class ReprefillMeter:
    """What interruptions cost one rollout (module doc): ``tokens`` prefilled again and
    ``seconds`` of re-prefill wall time, over ``interruptions``."""

    def __init__(self) -> None:
        self.tokens = 0
        self.interruptions = 0
        self._resumed_at: list[float] = []
        self._last_first_token: list[Optional[float]] = []

    def resumed(self) -> int:
        """An interruption is over: its continuations are about to be sent. Returns its index."""
        self.interruptions += 1
        self._resumed_at.append(time.monotonic())
        self._last_first_token.append(None)
        return self.interruptions - 1

    def continued(self, prompt_tokens: int) -> None:
        """One continuation sent, prefilling ``prompt_tokens`` again."""
        self.tokens += int(prompt_tokens)

    def first_token(self, interruption: int, at: float) -> None:
        """A continuation of ``interruption`` produced its first token at ``at`` (monotonic)."""
        last = self._last_first_token[interruption]
        self._last_first_token[interruption] = at if last is None else max(last, at)

    @property
    def seconds(self) -> float:
        return sum(max(0.0, last - resumed) for resumed, last in zip(self._resumed_at, self._last_first_token)
                   if last is not None)
