"""A server engine's replies are checked before anything is trained on them: whole or streamed,
a reply that is malformed, lacks its log-probs or finish reason, holds a non-finite or positive
log-prob, a token id outside the vocabulary, more tokens than asked for, or answers another
request (its id or its prompt) becomes an error result naming what is wrong; the agent loop
retries it and, past ``rollout.max_retries``, stops with ``EngineError`` naming the engine and the
request (the CLI's exit 4). A fake vLLM server plays each reply."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from atlas_lightning.rollout.engine import EngineError, GenerationRequest, SamplingSpec
from atlas_lightning.rollout.engines.server_engine import ServerEngine

VOCAB = 100
PROMPT = (1, 2, 3)


def _choice(tokens=(5, 6), logprobs=(-0.1, -0.2), finish="stop", prompt=PROMPT, **change) -> dict:
    choice = {"index": 0, "text": "xy", "finish_reason": finish, "token_ids": list(tokens), "prompt_token_ids":
              list(prompt), "logprobs": {"tokens": [f"token_id:{t}" for t in tokens],
                                         "token_logprobs": list(logprobs)}}
    choice.update(change)
    return choice


#: name -> (the events of a streamed reply, or one whole reply: choices[0]), what the error says
REPLIES = {
    "good": (_choice(), None),
    "no_logprobs": (_choice(logprobs=(), tokens=(), token_ids=None, logprobs_missing=True), "carries no log-probs"),
    "nan_logprob": (_choice(logprobs=(-0.1, float("nan"))), "the log-prob nan of a sampled token is not a finite"),
    "inf_logprob": (_choice(logprobs=(-0.1, float("-inf"))), "the log-prob -inf of a sampled token"),
    "positive_logprob": (_choice(logprobs=(-0.1, 0.7)), "the log-prob 0.7 of a sampled token"),
    "out_of_vocabulary": (_choice(tokens=(5, VOCAB)), f"token id {VOCAB} is outside the vocabulary (0..{VOCAB - 1})"),
    "negative_id": (_choice(tokens=(5, -1)), "token id -1 is outside the vocabulary"),
    "too_many": (_choice(tokens=(5, 6, 7, 8), logprobs=(-0.1,) * 4), "4 tokens, more than the 3 asked for"),
    "other_prompt": (_choice(prompt=(9, 9)), "the reply is for another prompt (2 tokens, not the 3 sent)"),
    "other_request": (_choice(), "the reply is for request 'cmpl-atlas-0000', not this one"),
    "no_finish": (_choice(finish=None), None),  # whole: finish_reason=None; streamed: the stream ends without one
    "bad_token": (_choice(logprobs=(-0.1, -0.2), tokens=(5, 6)) | {"logprobs": {
        "tokens": ["token_id:5", "six"], "token_logprobs": [-0.1, -0.2]}, "token_ids": None}, "invalid literal"),
}


def _event(body) -> bytes:
    """One server-sent event of ``body`` (JSON, or bytes as they are)."""
    return b"data: " + (body if isinstance(body, bytes) else json.dumps(body).encode()) + b"\n\n"


class _Server:
    """A vLLM server's routes as these tests need them; ``mode`` picks the completion's reply."""

    def __init__(self, model_dir) -> None:
        self.mode = "good"
        self.stream_mode = None  # a streamed reply's damage of its own (SSE level)
        self.models = {"data": [{"id": "base", "root": str(model_dir), "parent": None}]}
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _json(self, body, status=200):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._json(server.models)
                else:
                    self._json({})

            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                sent = self.headers.get("X-Request-Id", "none")
                reply_id = "cmpl-atlas-0000" if server.mode == "other_request" else f"cmpl-{sent}"
                choice = dict(REPLIES[server.mode][0])
                if choice.pop("logprobs_missing", False):
                    choice.pop("logprobs")
                if not payload.get("stream"):
                    self._json({"id": reply_id, "choices": [choice]})
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                for event in server.events(reply_id, choice):
                    self.wfile.write(event)
                    self.wfile.flush()
                self.close_connection = True

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def events(self, reply_id: str, choice: dict) -> list[bytes]:
        """The streamed reply (``stream_mode``: damaged so), else ``events_of``'s."""
        event = _event
        if self.stream_mode == "crlf":  # SSE's other line ending: the same reply
            return [e.replace(b"\n", b"\r\n") for e in self.events_of(reply_id, choice)]
        if self.stream_mode == "not_json":
            return [event(b"{\"id\": \"x\", \"choices\": [")]
        if self.stream_mode == "no_choices":
            return [event({"id": reply_id, "choices": []}), event(b"[DONE]")]
        if self.stream_mode == "cut":  # the connection ends with no finish reason and no [DONE]
            return [event({"id": reply_id, "choices": [_choice(tokens=(5,), logprobs=(-0.1,), finish=None)]})]
        if self.stream_mode == "after_finish":
            return [event({"id": reply_id, "choices": [_choice(tokens=(5,), logprobs=(-0.1,), finish="stop")]}),
                    event({"id": reply_id, "choices": [_choice(tokens=(6,), logprobs=(-0.2,), finish=None,
                                                               prompt_token_ids=None)]}), event(b"[DONE]")]
        return self.events_of(reply_id, choice)

    @staticmethod
    def events_of(reply_id: str, choice: dict) -> list[bytes]:
        """The choice's tokens one a chunk, the finish reason on the last, then ``[DONE]``."""
        event = _event
        logprobs = choice.get("logprobs")
        if not isinstance(logprobs, dict) or len(logprobs["tokens"]) < 2:
            return [event({"id": reply_id, "choices": [choice]}), event(b"[DONE]")]
        chunks = []
        for index in range(len(logprobs["tokens"])):
            last = index == len(logprobs["tokens"]) - 1
            chunks.append(event({"id": reply_id, "choices": [{
                **choice, "finish_reason": choice["finish_reason"] if last else None,
                "prompt_token_ids": choice["prompt_token_ids"] if index == 0 else None,
                "token_ids": None if choice["token_ids"] is None else choice["token_ids"][index:index + 1],
                "logprobs": {key: value[index:index + 1] for key, value in logprobs.items()}}]}))
        return chunks + [event(b"[DONE]")]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": VOCAB}))
    fake = _Server(model)
    yield fake
    fake.close()


def _result(engine: ServerEngine, rid: str = "q1/s1/t0/a0"):
    engine.submit(GenerationRequest(rid, PROMPT, SamplingSpec(max_tokens=3, seed=1)))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for result in engine.poll():
            return result
    raise AssertionError("no result")


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("mode", list(REPLIES))
def test_every_bad_reply_is_an_error_result_naming_what_is_wrong(server, mode, streaming):
    engine = ServerEngine(server.url, streaming=streaming, poll_wait_s=0.01)
    try:
        assert engine.vocab_size == VOCAB
        server.mode = mode
        result = _result(engine)
    finally:
        engine.close()
    expected = REPLIES[mode][1]
    if mode == "good":
        assert result.error is None and result.token_ids == [5, 6] and result.logprobs == [-0.1, -0.2]
    elif mode == "no_finish":
        assert result.error in ("finish_reason=None", "the stream ended without a finish reason"), result.error
        assert result.finish_reason == "error"
    else:
        assert result.finish_reason == "error" and expected in result.error, result.error


def test_a_stream_with_crlf_line_ends_reads_as_with_lf(server):
    engine = ServerEngine(server.url, streaming=True, poll_wait_s=0.01)
    try:
        server.stream_mode = "crlf"
        result = _result(engine)
    finally:
        engine.close()
    assert result.error is None and result.token_ids == [5, 6] and result.finish_reason == "stop"


@pytest.mark.parametrize("stream_mode, message", [
    ("not_json", "malformed stream event"),
    ("no_choices", "malformed stream chunk"),
    ("cut", "the stream ended without a finish reason"),
    ("after_finish", "tokens came after the finish reason 'stop'"),
])
def test_a_broken_stream_is_an_error_result_naming_it(server, stream_mode, message):
    engine = ServerEngine(server.url, streaming=True, poll_wait_s=0.01)
    try:
        server.stream_mode = stream_mode
        result = _result(engine)
    finally:
        engine.close()
    assert result.finish_reason == "error" and message in result.error, result.error


def test_a_bad_reply_stops_the_rollout_naming_the_engine_and_the_request(server):
    """Retried as any failed request, then ``EngineError`` (exit 4): never trained on."""
    from atlas_lightning.config import LoopLimits
    from atlas_lightning.env.episode import Episode
    from atlas_lightning.rollout.agent_loop import AgentLoop, Sampling, Trajectory
    from tests.harness import callbacks_harness

    harness = callbacks_harness()
    engine = ServerEngine(server.url, streaming=True, poll_wait_s=0.01)
    server.mode = "nan_logprob"
    traj = Trajectory(uid="gt1-0", session_id="s1", episode=Episode(harness.TRAIN_QUESTIONS[0], 0),
                      prompt_ids=list(PROMPT))
    loop = AgentLoop(engine, harness.make_chat(), LoopLimits(max_response_length=64, max_tokens_per_turn=3,
                                                             max_model_len=128, max_retries=1))
    try:
        with pytest.raises(EngineError) as info:
            loop.run([traj], Sampling())
    finally:
        engine.close()
    text = str(info.value)
    assert text.startswith("vllm-server engine: request gt1-0/s1/t0/a") and "failed 2 times" in text, text
    assert "a bad reply: the log-prob nan of a sampled token is not a finite number <= 0" in text
    assert traj.response_ids == []  # nothing of it reached the trajectory


def test_a_server_whose_model_folder_is_elsewhere_checks_ids_against_zero_only(server, tmp_path):
    from atlas_lightning.rollout.engines.server_engine import served_vocab_size

    assert served_vocab_size(str(tmp_path / "absent")) is None and served_vocab_size(None) is None
    (tmp_path / "mm").mkdir()
    (tmp_path / "mm" / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 7}}))
    assert served_vocab_size(str(tmp_path / "mm")) == 7


@pytest.mark.parametrize("models", [{"data": "nope"}, {"data": [{"name": "base"}]}, ["base"], {"object": "list"}])
def test_a_model_list_that_is_none_is_an_engine_error(server, models):
    server.models = models
    with pytest.raises(EngineError, match="/v1/models answered 200, not a list of models"):
        ServerEngine(server.url)
