"""Tiny random base models saved once per session (nothing downloaded)."""

from __future__ import annotations

import pytest
import torch

from atlas_lightning.models.tiny import save_tiny_causal_lm


@pytest.fixture(scope="session")
def qwen3_base(tmp_path_factory) -> str:
    """Attention-only Qwen3: hidden 64, 2 layers, head_dim 32, vocab 128, untied head."""
    return str(save_tiny_causal_lm(tmp_path_factory.mktemp("qwen3"), arch="qwen3"))


@pytest.fixture(scope="session")
def qwen3_tied_base(tmp_path_factory) -> str:
    """As ``qwen3_base`` but with the lm_head tied to the embeddings, other weights."""
    folder = tmp_path_factory.mktemp("qwen3_tied")
    return str(save_tiny_causal_lm(folder, arch="qwen3", tie_word_embeddings=True, seed=1))


@pytest.fixture(scope="session")
def qwen3_5_base(tmp_path_factory) -> str:
    """Hybrid Qwen3.5 (linear + full attention), saved in the VLM checkpoint layout."""
    return str(save_tiny_causal_lm(tmp_path_factory.mktemp("qwen3_5"), arch="qwen3_5"))


def randomize_adapters(model, seed: int = 1234, scale: float = 0.1) -> None:
    """LoRA B starts at zero (adapter = no-op); give all adapter weights non-zero values."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.actor_parameters() + model.critic_parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * scale)


@pytest.fixture
def randomize():
    return randomize_adapters
