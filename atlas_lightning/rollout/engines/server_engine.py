"""vLLM's OpenAI-compatible server as a rollout engine (``rollout.engine=vllm-server``).

``ServerEngine`` is the ``Engine`` the agent loop drives: token IDs in, token IDs and the
  log-prob of each sampled token out, over ``/v1/completions``; LoRA adapters are swapped with
  ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

The server itself runs as a child process (``server_process.VLLMServer``); this module is its
client. Who calls it: ``rollout.factory.build_engine`` (one server per engine), the separate
layout (``separate.py``), tests.

Semantics mirror ``vllm_engine.VLLMEngine`` (same engine arguments, ``processed_logprobs``, a
seed per request, ``stop_token_ids``, finish reason ``stop``/``length``, a new adapter name on
every sync). Differences a caller must know:

- The server applies the model's ``generation_config.json`` defaults to every sampling field a
  request leaves unset, so every request sets them all (penalties neutral, ``min_p`` 0).
  Its extra EOS ids are applied in both engines alike, so they are left alone.
- ``set_adapter``'s ``SyncReport`` is computed here, from the adapter folder's safetensors
  file (``adapter_folder.adapter_folder_digest``, an exact per-tensor digest): the server has
  no HTTP route to read back what its worker holds. It proves the folder holds what the trainer
  sent; that the server *serves* it is proven by the weight sync's log-prob probe
  (``rollout/sync.py``; ``prompt_logprobs`` through the same adapter name), which fails on a
  stale or missing adapter. ``set_adapter`` also checks that ``/v1/models`` lists the new
  adapter at that folder and no longer lists the old one.
- ``load_weights`` and ``load_merged`` (merged-weight sync) are not available here: merged
  weights reach a server through vLLM's weight-transfer API in the separate layout
  (``separate.SharedServerEngine.load_merged``, ``weight_transfer.py``); ``sleep``/``wake_up``
  are no-ops.
"""

from __future__ import annotations

import json
import logging
import queue
import uuid
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch

from atlas_lightning.rollout.engine import (
    AdapterVersion,
    Engine,
    EngineError,
    GenerationRequest,
    GenerationResult,
    SyncReport,
)
from atlas_lightning.rollout.engines.server_completion import (FINISHED, ID_PREFIX, ReplyCheck, StreamedCompletion,
                                                               choice_tokens)
from atlas_lightning.rollout.engines.server_http import (HTTP_ERRORS, Exchange, error_message, http_call,
                                                         http_stream, is_gone, quoted)
from atlas_lightning.rollout.engines.server_process import VLLMServer, log_tail
from atlas_lightning.rollout.digest import WeightDigest
from atlas_lightning.rollout.engines.adapter_folder import adapter_folder_digest

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------ the engine


class _Call:
    """One submission of a request: the worker thread fills ``result`` (always, errors as
    error results), sets ``gone`` when the server did not answer at all; ``abort`` cuts its
    ``exchange`` (vLLM aborts a request whose client disconnects)."""

    __slots__ = ("request", "body", "check", "exchange", "cancelled", "gone", "result", "future", "streamed")

    def __init__(self, request: GenerationRequest, body: bytes, check: ReplyCheck) -> None:
        self.request = request
        self.body = body
        #: What its reply must match; its ``sent_id`` goes as ``X-Request-Id``.
        self.check = check
        self.exchange = Exchange()
        self.cancelled = False
        self.gone: Optional[str] = None
        self.result: Optional[GenerationResult] = None
        self.future: Optional[Future] = None
        #: What a streamed call received so far (``streaming`` engines).
        self.streamed: Optional[StreamedCompletion] = None


class ServerEngine(Engine):
    """An ``Engine`` over a vLLM OpenAI-compatible server at ``url``.

    ``submit`` hands the request to a pool of ``max_in_flight`` threads, each holding one
    blocking ``/v1/completions`` call (the server batches them continuously); ``poll`` waits
    at most ``poll_wait_s`` for the first finished call and returns all finished ones. A call
    that fails at the HTTP level (status, malformed reply, socket timeout after
    ``request_timeout_s``) becomes a result with ``error`` set, which the agent loop retries;
    a server that no longer answers (connection refused or reset, and ``/health`` failing, or
    the owned process exited) makes ``poll`` raise ``EngineError``, now and on every later call.

    ``server``: the ``VLLMServer`` this engine owns and closes in ``close()`` (None when
    attaching to a server started elsewhere; it must run with runtime LoRA updating on).
    """

    name = "vllm-server"

    def __init__(
        self,
        url: str,
        *,
        server: Optional[VLLMServer] = None,
        max_in_flight: int = 64,
        request_timeout_s: float = 3600.0,
        poll_wait_s: float = 0.05,
        streaming: bool = False,
    ) -> None:
        self.url = url.rstrip("/")
        #: Stream every completion (``stream: true``), so that ``interrupt`` keeps what a request
        #: generated before the cut (partial rollouts); off, one reply per request, as before.
        self.streaming = streaming
        self.server = server
        self.request_timeout_s = request_timeout_s
        self.poll_wait_s = poll_wait_s
        self._dead: Optional[str] = None  # final: a gone server does not come back with our adapter
        #: The served model's vocabulary size, where its folder is readable here (token ids are checked below it).
        self.vocab_size: Optional[int] = None
        self._base = self._base_model_name()
        self._model = self._base  # what requests name: the served adapter, or the base
        self._adapter: Optional[str] = None
        self._syncs = 0
        self._tag = uuid.uuid4().hex[:6]  # adapter names unique across engines sharing a server
        self._calls: dict[str, _Call] = {}
        self._finished: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._pool = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="vllm-server")

    # -- plumbing ---------------------------------------------------------------------------

    def _call(self, method: str, path: str, payload: Optional[dict] = None,
              timeout: Optional[float] = 300.0) -> tuple[int, dict | str]:
        """A synchronous exchange; a server that does not answer raises ``EngineError``."""
        self._raise_if_dead()
        try:
            return http_call(self.url, method, path, payload, timeout=timeout)
        except HTTP_ERRORS as err:
            self._check_alive(f"{method} {path}: {type(err).__name__}: {err}")
            raise EngineError(f"vllm server {self.url}: {method} {path} failed: {type(err).__name__}: {err}") from err

    def _raise_if_dead(self) -> None:
        if self._dead is None and self.server is not None and not self.server.alive():
            try:
                self.server.check()
            except EngineError as err:
                self._dead = str(err)
        if self._dead is not None:
            raise EngineError(self._dead)

    def _check_alive(self, why: str) -> None:
        """After a connection failure: raise ``EngineError`` if the server is gone."""
        self._raise_if_dead()
        try:
            status, _ = http_call(self.url, "GET", "/health", timeout=10.0)
            if status == 200:
                return
            reason = f"/health answered {status}"
        except HTTP_ERRORS as err:
            reason = f"/health failed: {type(err).__name__}: {err}"
        where = f"; log {self.server.log_path}:\n{log_tail(self.server.log_path)}" if self.server else ""
        self._dead = f"vllm server {self.url} is gone ({why}; {reason}){where}"
        raise EngineError(self._dead)

    def _base_model_name(self) -> str:
        base = base_card(f"vllm server {self.url}", self._model_cards())
        self.vocab_size = served_vocab_size(base.get("root"))
        return base["id"]

    def _model_cards(self) -> dict[str, dict]:
        """``/v1/models``' cards by id (``model_cards``)."""
        status, body = self._call("GET", "/v1/models", timeout=30.0)
        return model_cards(f"vllm server {self.url}", status, body)

    # -- requests -----------------------------------------------------------------------------

    def _payload(self, request: GenerationRequest) -> dict:
        spec = request.sampling
        return {
            "model": self._model,
            # int(): numpy integers are not JSON
            "prompt": [int(t) for t in request.prompt_ids],
            "max_tokens": int(spec.max_tokens),
            "temperature": float(spec.temperature),
            "top_p": float(spec.top_p),
            "top_k": int(spec.top_k) if spec.top_k > 0 else 0,
            "seed": None if spec.seed is None else int(spec.seed),
            "stop_token_ids": [int(t) for t in spec.stop_token_ids],
            # the sampled token's log-prob, its ID as "token_id:N" (no re-tokenization), and
            # the IDs once more as a cross-check
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "skip_special_tokens": False,
            # neutral values, so that generation_config.json defaults never apply
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "min_p": 0.0,
            "n": 1,
            "stream": self.streaming,
        }

    def submit(self, request: GenerationRequest) -> None:
        old = self._calls.pop(request.request_id, None)
        if old is not None:  # a resubmission supersedes the earlier call
            self._cancel(old)
        check = ReplyCheck(request, f"{ID_PREFIX}{uuid.uuid4().hex}", self.vocab_size)
        call = _Call(request, json.dumps(self._payload(request)).encode(), check)
        self._calls[request.request_id] = call
        call.future = self._pool.submit(self._run, call)
        call.future.add_done_callback(lambda _, c=call: self._finished.put(c))

    def _run(self, call: _Call) -> None:
        """Worker thread: one blocking completion; never raises."""
        rid = call.request.request_id
        if call.cancelled:
            return
        try:
            if self.streaming:
                call.streamed = StreamedCompletion(call.check)
                for event in http_stream(self.url, "/v1/completions", call.body, timeout=self.request_timeout_s,
                                         exchange=call.exchange, request_id=call.check.sent_id):
                    call.streamed.add(event)
                call.result = call.streamed.result(rid)
                return
            status, body = http_call(self.url, "POST", "/v1/completions", body=call.body,
                                     timeout=self.request_timeout_s, exchange=call.exchange,
                                     request_id=call.check.sent_id)
        except HTTP_ERRORS as err:
            if not is_gone(err):
                call.result = GenerationResult(rid, [], [], "error", error=f"request failed: {type(err).__name__}: {err}")
                return
            if not call.cancelled:
                call.gone = f"{type(err).__name__}: {err}"
            call.result = GenerationResult(rid, [], [], "error", error=f"no answer from {self.url}: {err!r}")
            return
        call.result = self._parse(rid, status, body, call.check)

    @staticmethod
    def _parse(rid: str, status: int, body: dict | str, check: Optional[ReplyCheck] = None) -> GenerationResult:
        """A whole reply as the request's result; an error result for anything ``check`` refuses."""
        if status != 200 or not isinstance(body, dict):
            return GenerationResult(rid, [], [], "error", error=f"HTTP {status}: {error_message(body)}")
        try:
            choice = body["choices"][0]
            reason = choice["finish_reason"]
            token_ids, values = choice_tokens(choice)
        except ValueError as err:  # the tokens and log-probs missing, unreadable or disagreeing
            return GenerationResult(rid, [], [], "error", error=str(err))
        except (KeyError, IndexError, TypeError, AttributeError) as err:
            return GenerationResult(rid, [], [], "error", error=f"malformed completion ({quoted(repr(err), 80)}): {quoted(body)}")
        problem = check.identity_problem(body) if check is not None else None
        if problem is not None:
            return GenerationResult(rid, [], [], "error", error=f"a bad reply: {problem}")
        if reason not in FINISHED:
            return GenerationResult(rid, token_ids, values, "error", error=f"finish_reason={reason!r}")
        result = GenerationResult(rid, token_ids, values, reason)
        return result if check is None else check.result(result)

    def poll(self) -> list[GenerationResult]:
        self._raise_if_dead()
        if not self._calls:
            return []
        try:
            finished = [self._finished.get(timeout=self.poll_wait_s)]
        except queue.Empty:
            return []
        while True:
            try:
                finished.append(self._finished.get_nowait())
            except queue.Empty:
                break
        results, gone = [], None
        for call in finished:
            rid = call.request.request_id
            if self._calls.get(rid) is not call or call.result is None:
                continue  # aborted, superseded, or cancelled before it ran
            del self._calls[rid]
            gone = gone or call.gone
            results.append(call.result)
        if gone is not None:
            self._check_alive(gone)  # raises if the server is gone; else they are plain errors
        return results

    def num_pending(self) -> int:
        return len(self._calls)

    def abort(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            call = self._calls.pop(rid, None)
            if call is not None:
                self._cancel(call)

    def interrupt(self, request_ids: Iterable[str]) -> list[GenerationResult]:
        """Cut these streamed requests (vLLM aborts a request whose client goes) and return what
        each received before the cut (``Engine.interrupt``): tokens the server generated but had
        not sent are dropped with it, never half-kept."""
        if not self.streaming:
            raise NotImplementedError("vllm-server: interrupting requests needs the engine built with "
                                      "streaming=True (layout.partial_rollouts=true)")
        calls = [call for call in (self._calls.pop(rid, None) for rid in request_ids) if call is not None]
        for call in calls:
            self._cancel(call)
        wait([call.future for call in calls if call.future is not None], timeout=self.request_timeout_s)
        out = []
        for call in calls:
            rid = call.request.request_id
            if call.result is not None and call.result.error is None:  # it finished before the cut
                out.append(call.result)
            elif call.streamed is None:  # cut before it was sent
                out.append(GenerationResult(rid, [], [], "interrupted"))
            else:
                out.append(call.streamed.result(rid, interrupted=True))
        return out

    @staticmethod
    def _cancel(call: _Call) -> None:
        call.cancelled = True
        if call.future is not None:
            call.future.cancel()
        call.exchange.cut()  # the server sees the disconnect and aborts the request

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """Log-probs of tokens ``1..len-1`` under the served adapter, at temperature 1, from
        vLLM's ``prompt_logprobs`` extension (0: the prompt token's own log-prob only)."""
        payload = {"model": self._model, "prompt": [int(t) for t in token_ids], "max_tokens": 1, "temperature": 1.0,
                   "prompt_logprobs": 0, "skip_special_tokens": False}
        status, body = self._call("POST", "/v1/completions", payload)
        if status != 200 or not isinstance(body, dict):
            raise EngineError(f"vllm server {self.url}: prompt log-probs failed, HTTP {status}: {error_message(body)}")
        try:
            entries = body["choices"][0]["prompt_logprobs"]
            return [float(entries[i][str(token)]["logprob"]) for i, token in enumerate(token_ids) if i > 0]
        except (KeyError, IndexError, TypeError, ValueError) as err:  # an answer that is no probe: the engine's fault
            raise EngineError(f"vllm server {self.url}: prompt log-probs: malformed answer ({type(err).__name__}: "
                              f"{quoted(str(err), 80)}): {quoted(body)}") from err

    # -- weights ------------------------------------------------------------------------------

    def set_adapter(self, adapter: Optional[AdapterVersion]) -> SyncReport:
        """Unload the served adapter, then load ``adapter.folder`` under a name never used
        before and name it in every later request (None: serve the bare base). A failure
        raises ``EngineError`` and leaves the base served, never the previous adapter.

        The report's digest is computed from the folder (see the module doc): exact about the
        folder; the weight-sync probe is what checks what the server serves."""
        old = self._adapter
        if old is not None:
            self._adapter, self._model = None, self._base
            status, body = self._call("POST", "/v1/unload_lora_adapter", {"lora_name": old})
            if status != 200:
                raise EngineError(f"vllm server {self.url} did not unload adapter {old!r}: "
                                  f"HTTP {status}: {error_message(body)}")
        if adapter is None:
            return SyncReport(tensor_count=0, digest=WeightDigest(), form={"kind": "lora"})
        digest = adapter_folder_digest(adapter.folder)
        self._syncs += 1
        name = f"{adapter.name}-v{adapter.version}-s{self._syncs}-{self._tag}"
        path = str(Path(adapter.folder).resolve())
        status, body = self._call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        if status != 200:
            raise EngineError(f"vllm server {self.url} refused the adapter {adapter.folder}: "
                              f"HTTP {status}: {error_message(body)}")
        cards = self._model_cards()
        if cards.get(name, {}).get("root") != path or (old is not None and old in cards):
            raise EngineError(f"vllm server {self.url}: after loading, /v1/models lists {sorted(cards)}; "
                              f"wanted {name!r} at {path} and not {old!r}")
        self._adapter = self._model = name
        return SyncReport(tensor_count=len(digest), digest=digest, held="the adapter folder it loaded (client side)",
                          form={"kind": "lora", "dtype": None, "scale_b": False}, extra={"lora_name": name})

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> SyncReport:
        raise NotImplementedError(
            "vllm-server: merged weights (rollout.weight_sync=merged) reach a server in buckets through vLLM's "
            "weight-transfer API, in the separate layout (layout.mode=separate, separate.SharedServerEngine); "
            "use rollout.weight_sync=lora here")

    # -- memory -------------------------------------------------------------------------------

    def sleep(self) -> None:
        """A no-op: vLLM's CPU backend has no sleep, and on GPUs the server's ``/sleep`` route
        exists only in its dev mode; the factory refuses ``enable_sleep_mode`` for servers."""

    def wake_up(self) -> None:
        """A no-op (see ``sleep``)."""

    def close(self) -> None:
        """Abort what is pending, stop the threads, and stop the owned server."""
        self.abort(list(self._calls))
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.server is not None:
            self.server.close()


def model_cards(server: str, status: int, body) -> dict[str, dict]:
    """A server's ``/v1/models`` answer (``status``, decoded ``body``) as its model cards by id;
    ``EngineError`` beginning with ``server`` (who asked names it: the engine by its address, the
    start-up check by its config key) for an answer that is not a list of them."""
    cards = body.get("data") if status == 200 and isinstance(body, dict) else None
    if not isinstance(cards, list) or not all(isinstance(c, dict) and isinstance(c.get("id"), str) for c in cards):
        raise EngineError(f"{server}: /v1/models answered {status}, not a list of models: "
                          f"{error_message(body)}")
    return {card["id"]: card for card in cards}


def base_card(server: str, cards: dict[str, dict]) -> dict:
    """The card of the base model ``server`` serves (the first without a parent: adapters name
    theirs); ``EngineError`` beginning with ``server`` when it serves none."""
    bases = [card for card in cards.values() if not card.get("parent")]
    if not bases:
        raise EngineError(f"{server}: serves no base model (/v1/models lists {quoted(sorted(cards))})")
    return bases[0]


def served_vocab_size(root: Optional[str]) -> Optional[int]:
    """The vocabulary size in ``root/config.json`` (a served base's folder, from ``/v1/models``;
    a multimodal config's ``text_config``), or None where it cannot be read here (a server on
    another host): token ids are then only checked to be >= 0."""
    try:
        config = json.loads((Path(root) / "config.json").read_text())
    except (TypeError, OSError, ValueError):
        return None
    for where in (config, config.get("text_config") if isinstance(config, dict) else None):
        size = where.get("vocab_size") if isinstance(where, dict) else None
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return size
    return None
