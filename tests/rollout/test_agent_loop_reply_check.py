"""Every engine's replies are checked where they enter the agent loop (``rollout/reply_check.py``),
not only the server engine's: an engine (here a user plugin) whose reply holds a token id outside
the vocabulary, a non-finite or positive log-prob, too few log-probs or more tokens than asked
for is retried as a failed request and then stops the rollout with ``EngineError`` naming the
engine and the request; a valid reply passes as it came."""

from __future__ import annotations

import pytest

from atlas_lightning.config import LoopLimits
from atlas_lightning.env.episode import Episode, RuntimeConfig
from atlas_lightning.questions.uid import trajectory_uid
from atlas_lightning.rollout.agent_loop import AgentLoop, Sampling, Trajectory
from atlas_lightning.rollout.batch import session_id
from atlas_lightning.rollout.engine import Engine, EngineError, GenerationRequest, GenerationResult, SamplingSpec
from atlas_lightning.rollout.reply_check import checked
from tests.harness import callbacks_harness

H = callbacks_harness()
VOCAB = 1000


class BadReplies(Engine):
    """A plugin engine whose every reply is ``spoil(ids, logprobs)`` of a short valid one."""

    name = "plugin-under-test"
    vocab_size = VOCAB

    def __init__(self, spoil) -> None:
        self.spoil, self.queue, self.sent = spoil, [], []

    def submit(self, request) -> None:
        self.queue.append(request)
        self.sent.append(request.request_id)

    def num_pending(self) -> int:
        return len(self.queue)

    def poll(self):
        out = []
        for request in self.queue:
            ids, logprobs = self.spoil([5, 6, 7], [-0.1, -0.2, -0.3], request.sampling.max_tokens)
            out.append(GenerationResult(request.request_id, ids, logprobs, "length"))
        self.queue = []
        return out

    def prompt_logprobs(self, token_ids):
        raise NotImplementedError


SPOILED = {
    "out_of_vocabulary": (lambda ids, lp, n: ([5, VOCAB, 7], lp), f"token id {VOCAB} is outside the vocabulary"),
    "negative_id": (lambda ids, lp, n: ([5, -3, 7], lp), "token id -3 is outside the vocabulary"),
    "non_integer_id": (lambda ids, lp, n: ([5, 6.5, 7], lp), "its token ids are not integers"),
    "nan_logprob": (lambda ids, lp, n: (ids, [-0.1, float("nan"), -0.3]), "the log-prob nan"),
    "inf_logprob": (lambda ids, lp, n: (ids, [-0.1, -0.2, float("-inf")]), "the log-prob -inf"),
    "positive_logprob": (lambda ids, lp, n: (ids, [-0.1, 0.5, -0.3]), "the log-prob 0.5"),
    "logprobs_missing": (lambda ids, lp, n: (ids, []), "3 tokens but 0 log-probs"),
    "too_many_tokens": (lambda ids, lp, n: ([5] * (n + 1), [-0.1] * (n + 1)), "more than the"),
}


def _trajectory(chat) -> Trajectory:
    q = H.TRAIN_QUESTIONS[0]
    episode = Episode(q, 0, RuntimeConfig(max_explores=8, max_turns=4), seed=0)
    prompt = chat.prompt_ids(episode.messages(), episode.tools())
    episode.on_prompt_tokens(len(prompt))
    return Trajectory(uid=trajectory_uid(q.benchmark, q.question_id), session_id=session_id(0), episode=episode,
                      prompt_ids=prompt)


@pytest.fixture(scope="module")
def chat():
    return H.make_chat()


@pytest.mark.parametrize("case", sorted(SPOILED))
def test_a_bad_reply_from_any_engine_is_retried_then_stops_naming_engine_and_request(chat, case):
    spoil, problem = SPOILED[case]
    engine = BadReplies(spoil)
    limits = LoopLimits(max_response_length=200, max_tokens_per_turn=8, max_model_len=4096, max_retries=2)
    traj = _trajectory(chat)
    with pytest.raises(EngineError) as stopped:
        AgentLoop(engine, chat, limits).run([traj], Sampling())
    message = str(stopped.value)
    assert "plugin-under-test engine" in message and engine.sent[-1] in message and problem in message
    assert len(engine.sent) == 3  # the first try and max_retries=2 retries
    assert traj.response_ids == []  # nothing of a bad reply is kept


def test_a_valid_reply_passes_as_it_came():
    request = GenerationRequest("r", (1, 2), SamplingSpec(max_tokens=4))
    for result in (GenerationResult("r", [5, 6], [-0.5, 0.0], "stop"), GenerationResult("r", [], [], "interrupted"),
                   GenerationResult("r", [3, 999], [-1e-9, -30.0], "length"),
                   GenerationResult("r", [], [], "error", error="engine said no")):
        assert checked(request, result, "any", VOCAB) is result
