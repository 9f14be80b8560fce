"""Shared fixtures. Tests run on CPU; multi-process tests use gloo.

Expensive artefacts (the tiny model, the sample data, a vLLM engine) are built once per test
session into a temporary folder: nothing is downloaded.
"""

from __future__ import annotations

import os

import pytest

# vLLM's CPU backend reads these at import; set them before any test imports vllm.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from atlas_lightning.data.tiny_model import build_tiny_model

    out = tmp_path_factory.mktemp("tiny") / "tiny-model"
    build_tiny_model(out, seed=0)
    return out


@pytest.fixture(scope="session")
def sample_data_dir(tmp_path_factory):
    from atlas_lightning.data.sample import build_sample

    out = tmp_path_factory.mktemp("sample") / "sample-data"
    build_sample(out, seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir):
    """One in-process vLLM engine with LoRA enabled, shared by the tests that need it."""
    pytest.importorskip("vllm")
    from atlas_lightning.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(str(tiny_model_dir), dtype="float32", max_model_len=2048, lora_rank=8,
                        enforce_eager=True, seed=0)
    yield engine
    engine.close()
