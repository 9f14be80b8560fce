"""An engine that died is an ``EngineError`` naming the engine and the operation, at every entry
point (``rollout/engines/failure.py``): whatever vLLM raises then (an ``AssertionError`` from a
process group that is gone, an ``AttributeError`` on a released model, a ``RuntimeError``), the
weight sync's probe, ``set_adapter``, ``load_weights``, ``sleep``/``wake_up``, the requests. The
engine stays failed; an error of the trainer's own iterator passes unchanged; ``close`` of a
failed engine does not raise over the failure. The real death (vLLM's engine core shut down
during a fit) is in ``tests/e2e/test_faults.py``."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from atlas_lightning.rollout.engine import EngineError, GenerationRequest, SamplingSpec
from atlas_lightning.rollout.engines.failure import FailureGuard

DEATHS = [AssertionError("pipeline model parallel group is not initialized"),
          AttributeError("'NoneType' object has no attribute 'named_parameters'"),
          RuntimeError("EngineCore encountered an issue")]


class _Dead:
    """A vLLM object whose engine died: every method raises ``error``."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __getattr__(self, name: str):
        def dead(*args, **kwargs):
            raise self.error
        return dead


@pytest.mark.parametrize("error", DEATHS, ids=lambda e: type(e).__name__)
def test_guard_names_the_engine_and_operation_and_stays_failed(error):
    guard = FailureGuard("vllm")
    with pytest.raises(EngineError, match=rf"vllm engine failed during set_adapter: {type(error).__name__}") as raised:
        with guard.call("set_adapter"):
            raise error
    assert raised.value.__cause__ is error
    with pytest.raises(EngineError, match="failed earlier .*set_adapter.*; sleep not attempted"):
        with guard.call("sleep"):
            pytest.fail("a failed engine is not called again")


def test_guard_lets_its_own_errors_memory_and_the_callers_errors_pass():
    guard = FailureGuard("vllm")
    with pytest.raises(EngineError, match="^asleep$"), guard.call("submit"):
        raise EngineError("asleep")
    assert guard.failed is None  # the engine's own refusal is no failure of the engine

    class GatherFailed(RuntimeError):
        pass

    def weights():
        yield "a", torch.zeros(1)
        raise GatherFailed("the trainer's FSDP gather failed")

    def backend_consumes(items):
        try:
            list(items)
        except Exception as err:  # vLLM wraps what its loader met
            raise RuntimeError("weight loading failed") from err

    with pytest.raises(GatherFailed), guard.call("load_weights"):
        backend_consumes(guard.passing(weights()))
    with pytest.raises(torch.OutOfMemoryError), guard.call("wake_up"):
        raise torch.OutOfMemoryError("CUDA out of memory")
    assert guard.failed.startswith("wake_up: OutOfMemoryError")  # failed all the same
    with guard.closing():
        raise RuntimeError("shutdown of a dead engine")  # logged, not raised
    with pytest.raises(RuntimeError, match="working"), FailureGuard("vllm").closing():
        raise RuntimeError("a working engine's close error is raised")


def _dead_vllm_engine(error: BaseException):
    """A ``VLLMEngine`` whose ``vllm.LLM`` died (every call raises ``error``), a request pending,
    an adapter served, asleep where ``asleep``."""
    from atlas_lightning.rollout.engines.vllm_engine import VLLMEngine

    engine = object.__new__(VLLMEngine)
    dead = _Dead(error)
    engine.__dict__.update(guard=FailureGuard("vllm"), llm=dead, _engine=dead, _pending={"r0"}, _asleep=False,
                           _weights_dropped=False, _lora_enabled=True, _sleep_enabled=True, _sleep_level=1,
                           _lora=SimpleNamespace(lora_int_id=3, lora_path="/adapters/sync3"))
    return engine


def _entry_points():
    request = GenerationRequest("r1", (1, 2, 3), SamplingSpec(max_tokens=4))
    return {
        "submit": lambda e: e.submit(request),
        "a generation step (1 requests pending)": lambda e: e.poll(),
        "abort": lambda e: e.abort(["r0"]),
        "prompt_logprobs (the weight sync's probe)": lambda e: e.prompt_logprobs([1, 2, 3]),
        "set_adapter (removing the previous adapter)": lambda e: e.set_adapter(None),
        "reading back the adapter held": lambda e: e.held_adapter(),
        "load_weights": lambda e: e.load_weights(iter([("w", torch.zeros(2))])),
        "sleep": lambda e: e.sleep(),
        "wake_up": lambda e: (setattr(e, "_asleep", True), e.wake_up()),
    }


@pytest.mark.vllm  # the entry points import vllm's request types
@pytest.mark.parametrize("operation", list(_entry_points()))
def test_every_vllm_engine_entry_point_turns_a_dead_engine_into_engine_error(operation):
    pytest.importorskip("vllm")
    engine = _dead_vllm_engine(DEATHS[0])
    with pytest.raises(EngineError, match=f"^vllm engine failed during {re.escape(operation)}"):
        _entry_points()[operation](engine)
    engine._asleep = False
    with pytest.raises(EngineError, match="failed earlier"):
        engine.prompt_logprobs([1, 2, 3])
    engine.close()  # the failed engine's shutdown does not raise over its failure
    assert engine.llm is None


def test_server_probe_answer_that_is_no_probe_is_an_engine_error():
    from atlas_lightning.rollout.engines.server_engine import ServerEngine

    engine = object.__new__(ServerEngine)
    engine.__dict__.update(url="http://127.0.0.1:1", _model="base")
    engine._call = lambda *args, **kwargs: (200, {"choices": [{"text": "x"}]})
    with pytest.raises(EngineError, match="prompt log-probs: malformed answer .*KeyError"):
        engine.prompt_logprobs([1, 2, 3])
