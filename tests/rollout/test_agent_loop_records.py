"""The agent loop's trajectories become records whose per-token arrays agree with the episode's
token counts, whatever way an episode ends (a scripted engine; no model)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from atlas_lightning.env.episode import Episode, RuntimeConfig
from atlas_lightning.config import LoopLimits
from atlas_lightning.rollout.agent_loop import AgentLoop, Sampling, Trajectory
from atlas_lightning.questions.uid import trajectory_uid
from atlas_lightning.rollout.batch import assemble_batch, session_id
from atlas_lightning.reward import CostReward
from atlas_lightning.rollout.engine import Engine, GenerationResult
from atlas_lightning.store.records import read_record, write_record
from tests.harness import callbacks_harness



H = callbacks_harness()
TRAIN_QUESTIONS, make_chat, turn_text = H.TRAIN_QUESTIONS, H.make_chat, H.turn_text

EXPLORE = "E"


class ScriptedEngine(Engine):
    """Answers each trajectory's k-th request with its script's k-th turn, cut to the request's
    ``max_tokens`` (finish reason ``length``) as a real engine would."""

    name = "scripted"

    def __init__(self, chat, scripts: dict[str, list[str]]) -> None:
        self.chat, self.scripts, self.queue, self.turns = chat, scripts, [], {}

    def submit(self, request) -> None:
        self.queue.append(request)

    def num_pending(self) -> int:
        return len(self.queue)

    def poll(self):
        out = []
        for request in self.queue:
            key = request.request_id.rsplit("/t", 1)[0]
            turn = self.turns.get(key, 0)
            self.turns[key] = turn + 1
            benchmark = "lcb" if key.startswith("lcb") else "gpqa"
            ids = self.chat.tokenizer.encode(turn_text(self.scripts[key][turn], benchmark), add_special_tokens=False)
            ids.append(self.chat.stop_token_ids[0])
            cut = ids[: request.sampling.max_tokens]
            out.append(GenerationResult(request.request_id, cut, [-0.25 - 0.01 * i for i in range(len(cut))],
                                        "length" if len(cut) < len(ids) else "stop"))
        self.queue = []
        return out

    def prompt_logprobs(self, token_ids):
        raise NotImplementedError


@pytest.fixture(scope="module")
def chat():
    return make_chat()


def _run(chat, scripts: dict[str, list[str]], max_response_length: int):
    trajectories = []
    for q in TRAIN_QUESTIONS:
        episode = Episode(q, 0, RuntimeConfig(max_explores=8, max_turns=4), seed=0)
        prompt = chat.prompt_ids(episode.messages(), episode.tools())
        episode.on_prompt_tokens(len(prompt))
        trajectories.append(Trajectory(uid=trajectory_uid(q.benchmark, q.question_id), session_id=session_id(0),
                                       episode=episode, prompt_ids=prompt))
    engine = ScriptedEngine(chat, {f"{t.uid}/{t.session_id}": scripts[t.uid] for t in trajectories})
    limits = LoopLimits(max_response_length=max_response_length, max_tokens_per_turn=64, max_model_len=4096)
    stats = AgentLoop(engine, chat, limits, policy_version=lambda: 7).run(trajectories, Sampling())
    return assemble_batch(trajectories, step=1, partition="train", run_id="r",
                          scorer=CostReward(cost_per_usd=0.1), stats=stats, weights_version=0)


def test_records_carry_arrays_consistent_with_token_counts(chat, tmp_path):
    scripts = {"gpqa-gt1": [EXPLORE, "S:B"], "gpqa-gt2": [EXPLORE, EXPLORE, EXPLORE, EXPLORE],
               "lcb-lt1": [EXPLORE, EXPLORE, "S:#2"]}
    # A response budget that cuts the all-explore episode's later turn short: the truncated
    # turn is generated (mask 1) but never executed; the counts must still cover it.
    batch = _run(chat, scripts, max_response_length=150)
    reasons = {r.uid: r.episode["terminal_reason"] for r in batch.records}
    assert reasons["gpqa-gt1"] == "submitted" and reasons["gpqa-gt2"] == "response_length"
    truncated = [g for g in batch.records[1].episode["generations"] if g.get("truncated")]
    assert len(truncated) == 1
    for record, rewards in zip(batch.records, batch.token_rewards):
        counts = record.episode["token_counts"]
        mask = record.response_mask
        assert len(record.prompt_ids) == counts["prompt"]
        assert len(record.response_ids) == len(mask) == len(record.response_logprobs) == counts["response"]
        assert int(mask.sum()) == counts["generated"] and int((mask == 0).sum()) == counts["tool_response"]
        assert rewards.dtype == np.float32 and len(rewards) == counts["response"]
        # every generated token carries the weights version that sampled it; tool tokens none
        assert record.response_versions.tolist() == [7 if m else -1 for m in mask.tolist()]
        # the JSON carries the seed's four arrays and the versions, each on one line, and reads back identical
        path = write_record(tmp_path, record)
        text = path.read_text()
        data = json.loads(text)
        names = ["prompt_ids", "response_ids", "response_mask", "response_logprobs", "response_versions"]
        assert list(data)[-5:] == names
        for name in names:
            assert sum(1 for line in text.splitlines() if line.startswith(f' "{name}": [')) == 1
        back = read_record(path)
        for name, array in record.token_arrays().items():
            np.testing.assert_array_equal(getattr(back, name), array)
            assert getattr(back, name).dtype == array.dtype
    assert batch.metrics()["reward/mapped_slots_minus_events_max"] == 0
    assert batch.metrics()["reward/mapping_sum_error_max"] == 0.0
