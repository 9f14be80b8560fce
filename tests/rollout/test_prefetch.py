"""The asynchronous layout's producer (``data/prefetch.py``) against a scripted trainer: it
samples ahead, never more than ``max_staleness`` versions behind, hands steps over in order,
re-raises its failures and stops cleanly."""

from __future__ import annotations

import threading
import time

import pytest

from atlas_lightning.rollout.prefetch import RolloutProducer, WeightsClock


class _Trainer:
    """Takes steps in order, 'updates' for ``update_s`` and publishes version = steps done."""

    def __init__(self, clock: WeightsClock, update_s: float) -> None:
        self.clock, self.update_s = clock, update_s
        self.events: list[tuple[str, int, float]] = []

    def run(self, producer: RolloutProducer, steps: int) -> list[tuple[int, int, int]]:
        out = []
        self.clock.publish(0)
        for step in range(1, steps + 1):
            batch = producer.take(step)
            out.append((step, batch["version"], self.clock.version - batch["version"]))
            self.events.append(("update_start", step, time.monotonic()))
            time.sleep(self.update_s)
            self.events.append(("update_end", step, time.monotonic()))
            self.clock.publish(step)
        return out


def _until(condition, timeout_s: float = 20.0) -> None:
    """Waits for ``condition()`` (a loaded machine may start a thread late): the tests assert orders
    and lower bounds, never how soon a thread ran."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _steps(log: list) -> list[int]:
    return [s for _, s, _ in log]


def _sampler(lock: threading.Lock, clock: WeightsClock, log: list, rollout_s: float):
    def sample(step: int) -> dict:
        with lock:
            version = clock.version
            log.append(("rollout_start", step, time.monotonic()))
            time.sleep(rollout_s)
        return {"step": step, "version": version}
    return sample


@pytest.mark.parametrize("bound", [0, 1, 2])
def test_staleness_is_bounded_and_recorded(bound):
    clock, lock, log = WeightsClock(), threading.Lock(), []
    producer = RolloutProducer(_sampler(lock, clock, log, 0.01), clock, first=1, last=6, max_staleness=bound).start()
    seen = _Trainer(clock, update_s=0.15).run(producer, 6)
    producer.stop()
    assert [s for s, _, _ in seen] == list(range(1, 7))
    assert all(0 <= staleness <= bound for _, _, staleness in seen), seen
    # with fast rollouts and slow updates the producer runs as far ahead as the bound allows
    assert max(staleness for _, _, staleness in seen) == bound
    assert seen[0] == (1, 0, 0)


def test_rollout_of_the_next_step_overlaps_the_update():
    clock, lock, log = WeightsClock(), threading.Lock(), []
    trainer = _Trainer(clock, update_s=0.3)
    producer = RolloutProducer(_sampler(lock, clock, log, 0.05), clock, first=1, last=3, max_staleness=1).start()
    trainer.run(producer, 3)
    producer.stop()
    starts = {step: t for kind, step, t in log}
    spans = {(kind, step): t for kind, step, t in trainer.events}
    for k in (1, 2):  # rollout k+1 began while update k ran
        assert spans[("update_start", k)] - 0.25 < starts[k + 1] < spans[("update_end", k)]


def test_resume_point_and_stop_drop_what_was_sampled_ahead():
    clock, lock, log = WeightsClock(), threading.Lock(), []
    clock.publish(3)  # resumed at step 4 with the checkpoint's weights, version 3
    producer = RolloutProducer(_sampler(lock, clock, log, 0.01), clock, first=4, last=10, max_staleness=1).start()
    assert producer.take(4) == {"step": 4, "version": 3}
    _until(lambda: len(log) >= 2)  # step 5 is sampled ahead (5 - 1 - 3 = 1), step 6 is not allowed yet
    time.sleep(0.1)
    assert _steps(log) == [4, 5]
    producer.stop(timeout_s=5)
    assert not producer.alive
    with pytest.raises(RuntimeError, match="ended before step 5"):
        producer.take(5)


def test_a_failed_rollout_is_raised_in_the_trainer():
    clock = WeightsClock()
    clock.publish(0)

    def sample(step):
        raise ValueError(f"engine gone at step {step}")

    producer = RolloutProducer(sample, clock, first=1, last=3, max_staleness=1).start()
    with pytest.raises(ValueError, match="engine gone at step 1"):
        producer.take(1)
    with pytest.raises(RuntimeError, match="ended before step 1"):  # and it does not hang afterwards
        producer.take(1)
    with pytest.raises(RuntimeError, match="step 3 asked for, step 1 is next"):
        producer.take(3)


def test_nothing_is_sampled_before_the_first_sync():
    clock, lock, log = WeightsClock(), threading.Lock(), []
    producer = RolloutProducer(_sampler(lock, clock, log, 0.0), clock, first=1, last=2, max_staleness=1).start()
    time.sleep(0.1)
    assert log == []
    clock.publish(0)
    assert producer.take(1)["version"] == 0
    producer.stop()


def test_after_a_rollback_a_new_producer_starts_from_the_restored_weights():
    clock, lock, log = WeightsClock(), threading.Lock(), []
    clock.publish(3)
    clock.publish(1)  # the NaN guard restored global_step_1 after step 4
    assert clock.rollbacks == 1
    old = RolloutProducer(_sampler(lock, clock, log, 0.0), clock, first=5, last=9, max_staleness=1)
    assert not old.allowed(5, 1)  # counted from step numbers alone it would wait forever
    producer = RolloutProducer(_sampler(lock, clock, log, 0.0), clock, first=5, last=9, max_staleness=1,
                               base_version=1).start()
    assert producer.take(5) == {"step": 5, "version": 1}
    _until(lambda: len(log) >= 2)
    time.sleep(0.1)
    assert _steps(log) == [5, 6]  # one ahead, not two
    producer.stop()


def test_drop_policy_waits_for_room_not_for_weights():
    clock, lock, log = WeightsClock(), threading.Lock(), []
    clock.publish(0)
    producer = RolloutProducer(_sampler(lock, clock, log, 0.01), clock, first=1, last=6, max_staleness=1,
                               policy="drop").start()
    # no new weights: steps 1 and 2 are sampled (room for 1 + max_staleness), not 3; from the end of
    # step 2's 0.01 s sample, step 3 waits for room until step 1 is taken, about the 0.5 s slept here
    _until(lambda: len(log) >= 2)
    time.sleep(0.5)
    assert _steps(log) == [1, 2]
    assert producer.take(1) == {"step": 1, "version": 0}
    _until(lambda: len(log) >= 3)  # taking step 1 made room for step 3, still on version 0
    assert _steps(log) == [1, 2, 3]
    _until(lambda: 3 in producer.waited_s)
    assert set(producer.waited_s) == {1, 2, 3} and producer.waited_s[3] >= 0.2
    producer.stop(timeout_s=5)


def test_wait_policy_records_how_long_it_waited_for_weights():
    clock, lock, log = WeightsClock(), threading.Lock(), []
    producer = RolloutProducer(_sampler(lock, clock, log, 0.01), clock, first=1, last=2, max_staleness=0).start()
    time.sleep(0.2)  # the producer waits for weights from its start, so at least this long
    clock.publish(0)  # the first weights arrive: step 1 may start
    assert producer.take(1) == {"step": 1, "version": 0}
    assert producer.waited_s[1] >= 0.15
    producer.stop(timeout_s=5)
    with pytest.raises(ValueError, match="staleness_policy='skip' is not one of wait, drop"):
        RolloutProducer(lambda s: s, clock, first=1, last=2, max_staleness=1, policy="skip")
