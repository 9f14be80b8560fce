"""The asynchronous mode of ``RolloutDataModule`` (``layout.mode=separate``): training batches
sampled ahead by a producer thread, handed over within the staleness bound.

Contract (``AsynchronousSteps``, one a datamodule; the datamodule's train dataloader yields it
in this mode):

- A producer thread samples step ``k + 1`` while update ``k`` runs, never more than
  ``layout.max_staleness`` versions behind the trainer: ``prefetch.RolloutProducer`` (a whole
  step at a time), or with ``layout.partial_rollouts`` ``trajectory_producer.TrajectoryProducer``
  (trajectory by trajectory, across step boundaries). ``layout.staleness_policy``: ``wait``, the
  producer waits for the weight sync otherwise; ``drop``, it samples ahead regardless and the
  trajectories over the bound are dropped at hand-over.
- Every batch handed over gets ``staleness`` (the trainer's version minus the batch's), the
  histogram of its trajectories' staleness (``staleness_counts``, by each trajectory's oldest
  generated token: ``within_bound``), ``dropped``, the trainer's wait (``timing["wait_rollout"]``)
  and the producer's (``timing["engine_idle"]``). A step left with no trajectory is sampled
  again at once (not interruptible), so no step is skipped.
- After a NaN-guard rollback (``WeightsClock.rollbacks``) what was sampled ahead, with the
  discarded weights, is dropped and sampled again on the restored ones.
- A resumed run with partial rollouts continues the steps in flight its checkpoint kept
  (``restore``, ``inflight.py``): the producer takes them once (``take_restored``), from the
  first step it samples on.
- Steps are taken in order from the datamodule's ``next_step``, which advances as each is
  handed over (the data cursor: a step sampled ahead but not trained on is sampled again after
  a restart, never lost or counted twice). ``stop`` ends the producer and drops what it sampled
  ahead.
- The producer draws nothing from the process's global generators (torch's, CUDA's, numpy's,
  Python's), which the update draws its LoRA dropout masks from while the producer samples: each
  request carries its own seed (``engine.request_seed``), the engines sample from it (the
  vLLM server in its own process; the transformers reference from a ``torch.Generator`` of that
  seed), episodes permute their candidates by a hash, and the client's request ids come from
  ``uuid4`` (the OS). So a resumed run's masks do not depend on how the two threads interleave
  (tests/rollout/test_datamodule_async.py, tests/rollout/test_server_engine.py).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Iterator, Optional, Union

from atlas_lightning.rollout import inflight
from atlas_lightning.rollout.batch import RolloutBatch
from atlas_lightning.rollout.prefetch import RolloutProducer
from atlas_lightning.rollout.trajectory_producer import OpenStep, TrajectoryProducer

log = logging.getLogger(__name__)


class AsynchronousSteps:
    """The training batches of ``dm``, a ``RolloutDataModule``, in asynchronous mode (module
    doc), as an iterable: its producer thread (``producer``), the steps in flight a resumed
    checkpoint kept (``restored``) and the hand-over of each step within the bound."""

    def __init__(self, dm) -> None:
        self.dm = dm
        #: The thread sampling ahead (None before the first batch and after ``stop``).
        self.producer: Optional[Union[RolloutProducer, TrajectoryProducer]] = None
        #: The steps in flight the resumed checkpoint kept, until the producer takes them.
        self.restored: dict[int, OpenStep] = {}

    @property
    def bound(self) -> int:
        """``layout.max_staleness``."""
        return int(self.dm.cfg.layout.max_staleness)

    @property
    def policy(self) -> str:
        """``layout.staleness_policy``: ``wait`` or ``drop`` (``prefetch.py``)."""
        return str(self.dm.cfg.layout.get("staleness_policy", "wait"))

    def restore(self, checkpoint: Path) -> None:
        """The steps in flight that ``checkpoint`` (the verified ``global_step_N`` a resumed run
        continues) kept, held for the producer (once: what it took is not read again)."""
        if self.restored:
            return
        self.restored = inflight.restore(checkpoint)
        if self.restored:
            log.info("resuming %d steps in flight (%d generated tokens) from %s", len(self.restored),
                     inflight.saved_tokens(self.restored), checkpoint)

    def __iter__(self) -> Iterator[RolloutBatch]:
        dm = self.dm
        producer = self.start(dm.next_step)
        try:
            while dm.next_step <= dm.total_steps:
                step = dm.next_step
                started = time.monotonic()
                if producer.rollbacks != dm.clock.rollbacks:
                    # a NaN-guard rollback restored older weights: what was sampled ahead used the
                    # discarded ones; sample from here again, on the restored version
                    log.warning("weights rolled back to v%s: sampling step %d again", dm.weights_version, step)
                    producer = self.start(step, base_version=dm.weights_version)
                batch = producer.take(step)
                batch.timing["engine_idle"] = producer.waited_s.pop(step, 0.0)
                batch = self._handed_over(batch, started)
                if not len(batch):  # every trajectory was over the bound (drop): sample the step now
                    log.warning("step %d: all %d trajectories over layout.max_staleness; sampling it again",
                                step, batch.dropped)
                    again = self._handed_over(dm.rollout(step, interruptible=False), started)
                    again.dropped += batch.dropped
                    batch = again
                dm.next_step = step + 1
                yield batch
        finally:
            producer.stop(timeout_s=0)

    def start(self, first: int, base_version: Optional[int] = None) -> Union[RolloutProducer, TrajectoryProducer]:
        """A producer thread sampling steps ``first .. total_steps`` (the one before it stopped);
        step ``first`` is trained on weights ``base_version`` (default ``first - 1``)."""
        dm = self.dm
        if self.producer is not None:
            self.producer.stop(timeout_s=0)
        if dm.partial_rollouts:  # scheduling by trajectory (``trajectory_producer.py``)
            self.producer = TrajectoryProducer(
                dm, dm.clock, dm.pause, first=first, last=dm.total_steps, max_staleness=self.bound,
                base_version=base_version, policy=self.policy, restored=self.take_restored(first)).start()
            return self.producer
        self.producer = RolloutProducer(dm.rollout, dm.clock, first=first, last=dm.total_steps,
                                        max_staleness=self.bound, base_version=base_version,
                                        policy=self.policy).start()
        return self.producer

    def take_restored(self, first: int) -> dict[int, OpenStep]:
        """The kept steps in flight from ``first`` on, handed to the producer once."""
        steps, self.restored = self.restored, {}
        return {step: opened for step, opened in steps.items() if step >= first}

    def _handed_over(self, batch: RolloutBatch, started: float) -> RolloutBatch:
        """``batch`` as the trainer gets it (``RolloutDataModule.handed_over``: staleness, the wait
        since ``started``), its trajectories held to the bound (``within_bound``)."""
        dm = self.dm
        batch = dm.handed_over(batch, waited_s=time.monotonic() - started)
        if batch.weights_version is not None and dm.weights_version is not None:
            batch = within_bound(batch, dm.weights_version, self.bound, self.policy)
        return batch

    def stop(self) -> None:
        """End the producer; what it sampled ahead is dropped."""
        if self.producer is not None:
            self.producer.stop(timeout_s=0)
            self.producer = None


def within_bound(batch: RolloutBatch, trainer_version: int, bound: int, policy: str) -> RolloutBatch:
    """``batch`` with each trajectory's staleness (``trainer_version`` minus its oldest generated
    token's version, ``RolloutBatch.oldest_versions``) counted into ``staleness_counts``; one over
    ``bound`` is dropped (``drop``, counted in ``dropped``) or refused (``wait``, whose producer
    never samples one: it would be a bug)."""
    lags = [trainer_version - v for v in batch.oldest_versions()]
    worst = max(lags, default=0)
    if min(lags, default=0) < 0 or (policy == "wait" and worst > bound):
        raise RuntimeError(f"step {batch.step} was sampled with weights v{batch.weights_version}, the trainer "
                           f"holds v{trainer_version}: staleness {worst} outside [0, {bound}]")
    kept = [i for i, lag in enumerate(lags) if lag <= bound]
    if len(kept) < len(lags):
        log.warning("step %d: %d of %d trajectories over layout.max_staleness=%d dropped",
                    batch.step, len(lags) - len(kept), len(lags), bound)
        batch = batch.subset(kept)
        batch.dropped = len(lags) - len(kept)
    batch.staleness_counts = {k: sum(1 for i in kept if lags[i] == k) for k in range(bound + 1)}
    return batch
