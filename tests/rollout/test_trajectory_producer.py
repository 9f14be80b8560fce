"""Scheduling by trajectory (``rollout/trajectory_producer.py``) with a scripted engine (no model):
trajectories start across step boundaries within ``(version - base + max_staleness + 1) x batch``,
a step is handed over when its own trajectories are done, and a snapshot taken under the pause
continues, after a restore, into exactly the records an uninterrupted run gives (nothing
generated again, no trajectory skipped or repeated)."""

from __future__ import annotations

import pickle
import threading
import time

import pytest

from atlas_lightning.config import LoopLimits
from atlas_lightning.env.episode import Episode, RuntimeConfig
from atlas_lightning.questions.uid import trajectory_uid
from atlas_lightning.reward import CostReward
from atlas_lightning.rollout import inflight
from atlas_lightning.rollout.agent_loop import AgentLoop, Sampling, Trajectory
from atlas_lightning.rollout.batch import assemble_batch, session_id
from atlas_lightning.rollout.engine import Engine, GenerationResult
from atlas_lightning.rollout.interruption import SyncPause
from atlas_lightning.rollout.prefetch import WeightsClock
from atlas_lightning.rollout.trajectory_producer import TrajectoryProducer
from tests.harness import callbacks_harness



H = callbacks_harness()
SCRIPTS = {"gpqa-gt1": ["E", "S:B"], "gpqa-gt2": ["E", "E", "E", "E"], "lcb-lt1": ["E", "E", "S:#2"]}


class SlowScript(Engine):
    """Each trajectory's k-th turn is its script's; a request yields ``per_poll`` tokens a poll
    and finishes when its turn is out; ``interrupt`` hands back what it produced so far.
    Log-probs depend on the token's place in its turn: a continuation's line up with an
    uninterrupted turn's. One instance is the "server": it remembers how far each turn went."""

    name = "slow-script"

    def __init__(self, chat, per_poll: int = 3) -> None:
        self.chat, self.per_poll, self.queue, self.given = chat, per_poll, {}, {}
        self.sent: list[str] = []

    def _turn(self, rid: str):
        uid, sess, turn = rid.split("/")[:3]
        benchmark = "lcb" if uid.startswith("lcb") else "gpqa"
        ids = self.chat.tokenizer.encode(H.turn_text(SCRIPTS[uid][int(turn[1:])], benchmark), add_special_tokens=False)
        return f"{uid}/{sess}/{turn}", ids + [self.chat.stop_token_ids[0]]

    def submit(self, request) -> None:
        key, _ = self._turn(request.request_id)
        self.queue[request.request_id] = [request, self.given.get(key, 0), 0]
        self.sent.append(request.request_id)

    def num_pending(self) -> int:
        return len(self.queue)

    def _result(self, rid: str, reason: str) -> GenerationResult:
        request, first, made = self.queue.pop(rid)
        key, ids = self._turn(rid)
        cut = ids[first:first + made]
        self.given[key] = first + made
        if reason != "interrupted":
            reason = "stop" if first + made == len(ids) else "length"
        return GenerationResult(rid, cut, [-0.5 - 0.01 * (first + i) for i in range(len(cut))], reason)

    def poll(self):
        done = []
        for rid, entry in list(self.queue.items()):
            request, first, made = entry
            _, ids = self._turn(rid)
            entry[2] = min(made + self.per_poll, len(ids) - first, request.sampling.max_tokens)
            if entry[2] in (len(ids) - first, request.sampling.max_tokens):
                done.append(self._result(rid, "done"))
        time.sleep(0.001)
        return done

    def interrupt(self, request_ids):
        return [self._result(rid, "interrupted") for rid in request_ids]

    def abort(self, request_ids) -> None:
        for rid in request_ids:
            self.queue.pop(rid, None)

    def prompt_logprobs(self, token_ids):
        raise NotImplementedError


class Source:
    """A ``StepSource``: the harness' three questions, one sample each, every step."""

    sampling = Sampling()

    def __init__(self, chat, engine) -> None:
        self.chat, self.engine, self.version = chat, engine, 0
        self.limits = LoopLimits(max_response_length=4000, max_tokens_per_turn=64, max_model_len=8192, max_in_flight=4)

    def train_trajectories(self, step: int) -> list[Trajectory]:
        out = []
        for q in H.TRAIN_QUESTIONS:
            episode = Episode(q, 0, RuntimeConfig(max_explores=8, max_turns=4), seed=0)
            prompt = self.chat.prompt_ids(episode.messages(), episode.tools())
            episode.on_prompt_tokens(len(prompt))
            out.append(Trajectory(uid=trajectory_uid(q.benchmark, q.question_id), session_id=session_id(step),
                                  episode=episode, prompt_ids=prompt, seed_parts=(0, "train", step)))
        return out

    def agent_loop(self, pause):
        return AgentLoop(self.engine, self.chat, self.limits, policy_version=lambda: self.clock.version, pause=pause)

    def assemble_step(self, step, trajectories, stats, version, timing):
        batch = assemble_batch(trajectories, step=step, partition="train", run_id="r",
                               scorer=CostReward(cost_per_usd=0.1), stats=stats, weights_version=version)
        batch.timing.update(timing)
        return batch


def _producer(chat, engine, clock, *, last=4, restored=None, first=1, base=None):
    source = Source(chat, engine)
    source.clock = clock
    pause = SyncPause(threading.RLock())
    producer = TrajectoryProducer(source, clock, pause, first=first, last=last, max_staleness=1,
                                  base_version=base, restored=restored)
    return producer, pause


def _sync(pause: SyncPause, clock: WeightsClock, version: int) -> None:
    with pause.hold():
        clock.publish(version)


@pytest.fixture(scope="module")
def chat():
    return H.make_chat()


def test_trajectories_start_across_steps_within_the_staleness_room(chat):
    clock = WeightsClock()
    clock.publish(0)
    producer, pause = _producer(chat, SlowScript(chat), clock)
    seen = []
    admit = producer.admit

    def watched(room):
        out = admit(room)
        seen.append((clock.version, producer.started))
        return out

    producer.admit = watched
    producer.start()
    batches = []
    for step in range(1, 5):
        batches.append(producer.take(step))
        time.sleep(0.05)  # the "update": the producer runs on within its room
        if step == 1:  # version 0 serves steps 1 and 2 (max_staleness 1), nothing of step 3
            assert producer.started == 6 and 3 not in producer._open
        _sync(pause, clock, step)
    producer.stop(timeout_s=10)
    # never more started than (version - base + max_staleness + 1) x batch
    assert all(started <= (version + 2) * 3 for version, started in seen)
    assert [b.step for b in batches] == [1, 2, 3, 4] and all(len(b) == 3 for b in batches)
    for batch in batches:
        # the trajectories of a step are that step's (its session), complete, version-stamped
        assert {r.session_id for r in batch.records} == {session_id(batch.step)}
        oldest = batch.oldest_versions()
        assert all(batch.step - 1 - v <= 1 for v in oldest)  # staleness within the bound
    # step 2 was sampled while "update 1" ran: with version 0
    assert batches[1].weights_version == 0


def _records(batches):
    return {(b.step, r.uid, r.session_id): (r.response_ids.tolist(), r.response_logprobs.tolist())
            for b in batches for r in b.records}


def test_a_snapshot_under_the_pause_continues_without_loss(chat, tmp_path):
    clock = WeightsClock()
    clock.publish(0)
    straight, pause = _producer(chat, SlowScript(chat), clock, last=3)
    straight.start()
    whole = [straight.take(1)]
    _sync(pause, clock, 1)
    whole += [straight.take(2), straight.take(3)]
    straight.stop(timeout_s=10)

    engine = SlowScript(chat, per_poll=1)
    clock = WeightsClock()
    clock.publish(0)
    first, pause = _producer(chat, engine, clock, last=3)
    first.start()
    got = [first.take(1)]
    _sync(pause, clock, 1)
    while sum(len(t.response_ids) for o in first._open.values() for t in o.trajectories) < 10:
        time.sleep(0.001)
    with pause.hold():  # the checkpoint's cut
        steps = first.snapshot()
        files = {"rank_0.pkl": pickle.dumps({"format": inflight.FORMAT, "rank": 0, "steps": [
            {"step": o.step, "version": o.version, "trajectories": o.trajectories} for o in steps]})}
        first.stop(timeout_s=0)
    first.stop(timeout_s=10)
    inflight.write(files, tmp_path)
    restored = inflight.restore(tmp_path)
    saved = inflight.saved_tokens(restored)
    assert 2 in restored and saved > 0  # step 3 too, if it had opened at the cut

    # the "resumed run": the same server (it keeps what it streamed), weights v1, from step 2
    resumed, pause = _producer(chat, engine, clock, last=3, first=2, base=1, restored=restored)
    resumed.start()
    got += [resumed.take(2), resumed.take(3)]
    resumed.stop(timeout_s=10)
    assert _records(got).keys() == _records(whole).keys()  # nothing skipped, nothing twice
    assert _records(got) == _records(whole)  # the same tokens and log-probs
    # every saved token is in the trained records: none was generated again
    for step, opened in restored.items():
        for traj in opened.trajectories:
            ids, _ = _records(got)[(step, traj.uid, traj.session_id)]
            assert ids[:len(traj.response_ids)] == traj.response_ids
