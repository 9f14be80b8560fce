"""Partial rollouts in the agent loop (a scripted engine; no model): a weight sync interrupts the
requests in flight, their tokens are kept with the version that sampled them, and the open
turns continue under the new version, so a turn straddles two versions while the records hold
exactly the tokens an uninterrupted rollout would (the script is the same whatever the weights),
and the re-prefill is counted. Also the pause between a sync and a rollout on two threads."""

from __future__ import annotations

import threading
import time

import pytest

from atlas_lightning.config import LoopLimits
from atlas_lightning.env.episode import Episode, RuntimeConfig
from atlas_lightning.questions.uid import trajectory_uid
from atlas_lightning.reward import CostReward
from atlas_lightning.rollout.agent_loop import AgentLoop, Sampling, Trajectory
from atlas_lightning.rollout.batch import assemble_batch, session_id
from atlas_lightning.rollout.engine import Engine, GenerationResult
from atlas_lightning.rollout.interruption import ReprefillMeter, SyncPause
from tests.harness import callbacks_harness



H = callbacks_harness()
EXPLORE = "E"
SCRIPTS = {"gpqa-gt1": [EXPLORE, "S:B"], "gpqa-gt2": [EXPLORE, EXPLORE, EXPLORE, EXPLORE],
           "lcb-lt1": [EXPLORE, EXPLORE, "S:#2"]}


class StreamingScript(Engine):
    """Each trajectory's k-th turn is its script's k-th turn; ``interrupt`` hands back the first
    half of what a request has left of its turn (what it "streamed" before the cut), and a
    continuation produces the rest. Log-probs depend on the token's place in the turn, so a
    continuation's must line up with the uninterrupted turn's."""

    name = "streaming-script"

    def __init__(self, chat) -> None:
        self.chat, self.queue, self.given = chat, {}, {}
        self.seeds: list[tuple[str, int]] = []
        self.prompt_lengths: dict[str, int] = {}

    def _turn(self, rid: str) -> tuple[str, list[int]]:
        uid, sess, turn = rid.split("/")[:3]
        benchmark = "lcb" if uid.startswith("lcb") else "gpqa"
        ids = self.chat.tokenizer.encode(H.turn_text(SCRIPTS[uid][int(turn[1:])], benchmark), add_special_tokens=False)
        return f"{uid}/{sess}/{turn}", ids + [self.chat.stop_token_ids[0]]

    def submit(self, request) -> None:
        self.queue[request.request_id] = request
        self.seeds.append((request.request_id, request.sampling.seed))
        self.prompt_lengths[request.request_id] = len(request.prompt_ids)

    def num_pending(self) -> int:
        return len(self.queue)

    def _emit(self, request, count: int, reason: str) -> GenerationResult:
        key, ids = self._turn(request.request_id)
        first = self.given.get(key, 0)
        cut = ids[first:first + min(count, request.sampling.max_tokens)]
        self.given[key] = first + len(cut)
        if reason != "interrupted":
            reason = "stop" if first + len(cut) == len(ids) else "length"
        return GenerationResult(request.request_id, cut, [-0.5 - 0.01 * (first + i) for i in range(len(cut))], reason)

    def poll(self):
        out = [self._emit(r, 10**6, "done") for r in self.queue.values()]
        self.queue = {}
        return out

    def interrupt(self, request_ids):
        out = []
        for rid in request_ids:
            request = self.queue.pop(rid)
            key, ids = self._turn(rid)
            out.append(self._emit(request, max(1, (len(ids) - self.given.get(key, 0)) // 2), "interrupted"))
        return out

    def prompt_logprobs(self, token_ids):
        raise NotImplementedError


class SyncEveryRound:
    """A weight sync that asks for the engine whenever requests are in flight, ``times`` times;
    ``give_way`` is the sync: the version goes up by one."""

    def __init__(self, engine: StreamingScript, times: int) -> None:
        self.engine, self.left, self.version = engine, times, 7

    def requested(self) -> bool:
        return self.left > 0 and bool(self.engine.queue)

    def give_way(self) -> None:
        self.left -= 1
        self.version += 1


def _trajectories(chat) -> list[Trajectory]:
    out = []
    for q in H.TRAIN_QUESTIONS:
        episode = Episode(q, 0, RuntimeConfig(max_explores=8, max_turns=4), seed=0)
        prompt = chat.prompt_ids(episode.messages(), episode.tools())
        episode.on_prompt_tokens(len(prompt))
        out.append(Trajectory(uid=trajectory_uid(q.benchmark, q.question_id), session_id=session_id(0),
                              episode=episode, prompt_ids=prompt))
    return out


def _rollout(chat, syncs: int):
    engine = StreamingScript(chat)
    pause = SyncEveryRound(engine, syncs)
    limits = LoopLimits(max_response_length=4000, max_tokens_per_turn=64, max_model_len=8192)
    loop = AgentLoop(engine, chat, limits, policy_version=lambda: pause.version, pause=pause if syncs else None)
    trajectories = _trajectories(chat)
    stats = loop.run(trajectories, Sampling(), seed_parts=(1, "train", 3))
    batch = assemble_batch(trajectories, step=3, partition="train", run_id="r", scorer=CostReward(cost_per_usd=0.1),
                           stats=stats, weights_version=7)
    return batch, loop, engine


@pytest.fixture(scope="module")
def chat():
    return H.make_chat()


def test_interrupted_turns_keep_their_tokens_and_continue_under_the_new_version(chat):
    whole, _, plain = _rollout(chat, syncs=0)
    cut, loop, engine = _rollout(chat, syncs=3)
    assert loop.reprefill.interruptions == 3
    straddling = 0
    for a, b in zip(whole.records, cut.records):
        # the same tokens, log-probs, mask and ending: nothing regenerated, nothing re-encoded
        assert b.response_ids.tolist() == a.response_ids.tolist()
        assert b.response_logprobs.tolist() == a.response_logprobs.tolist()
        assert b.response_mask.tolist() == a.response_mask.tolist()
        assert b.episode["terminal_reason"] == a.episode["terminal_reason"]
        assert b.episode["token_counts"] == a.episode["token_counts"]
        versions = b.response_versions.tolist()
        assert all((v == -1) == (m == 0) for v, m in zip(versions, b.response_mask.tolist()))
        generated = [v for v in versions if v != -1]
        assert generated == sorted(generated) and generated[0] == 7 and generated[-1] == 10
        # a turn (generated tokens between two tool responses) carrying two versions
        turns, current = [], []
        for v, m in zip(versions, b.response_mask.tolist()):
            if m:
                current.append(v)
            elif current:
                turns.append(current)
                current = []
        turns.append(current)
        straddling += sum(1 for t in turns if len(set(t)) > 1)
    assert straddling >= 3
    # continuations: their own request ids and seeds, their prompts the whole prefix so far
    continued = {rid: seed for rid, seed in engine.seeds if "/s" in rid}
    assert continued and not set(continued.values()) & {seed for _, seed in plain.seeds}
    assert loop.reprefill.tokens == sum(engine.prompt_lengths[rid] for rid in continued)
    assert cut.stats.generated_tokens == whole.stats.generated_tokens


def test_without_a_pause_the_loop_sends_what_it_always_sent(chat):
    _, loop, engine = _rollout(chat, syncs=0)
    assert loop.reprefill.tokens == 0 and loop.reprefill.interruptions == 0
    assert all("/s" not in rid for rid, _ in engine.seeds)


def test_a_sync_waits_for_the_rollout_to_give_way_then_the_rollout_waits_for_the_sync():
    lock = threading.RLock()
    pause = SyncPause(lock)
    events: list[str] = []

    def rollout() -> None:
        with lock:
            while not pause.requested():
                time.sleep(0.005)
            events.append("interrupted")
            pause.give_way()
            events.append("resumed")

    worker = threading.Thread(target=rollout)
    worker.start()
    time.sleep(0.05)  # the rollout holds the engine
    with pause.hold():  # the sync: granted only once the rollout gives way
        events.append("sync")
        time.sleep(0.05)  # the rollout must not resume under a sync
        events.append("synced")
    worker.join(timeout=10)
    assert events == ["interrupted", "sync", "synced", "resumed"]
    assert not pause.requested()


def test_reprefill_seconds_run_from_resumption_to_the_last_first_token():
    meter = ReprefillMeter()
    first = meter.resumed()
    start = meter._resumed_at[first]
    meter.continued(100)
    meter.continued(50)
    meter.first_token(first, start + 0.5)
    meter.first_token(first, start + 0.25)
    assert meter.tokens == 150 and meter.interruptions == 1
    assert meter.seconds == pytest.approx(0.5)
