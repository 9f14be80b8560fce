"""Model shapes the benchmark builds with random weights, straight on the device.

* ``dense8b``: the Qwen3-8B shape (hidden 4096, 36 layers, 32 query / 8 KV heads of 128,
  MLP 12288, vocabulary 151,936): an 8B dense transformer, packed layout.
* ``qwen3_6_27b``: the Qwen3.6-27B text shape (transformers ``qwen3_5`` architecture: hidden
  5120, 64 layers, three Gated DeltaNet linear-attention layers to one full-attention layer,
  24 query / 4 KV heads of 256 with an output gate, linear attention 16 key / 48 value heads of
  128, MLP 17408, vocabulary 248,320): recurrent layers, so the padded layout.
* ``tiny`` / ``tiny_hybrid``: the same two architectures at toy size, for CPU smoke runs.

``layers`` cuts the decoder to its first ``n`` layers (the hybrid keeps its 3:1 pattern when
``n`` is a multiple of 4): per-layer cost and MFU are what a shorter stack measures; tokens a
second scale by ``full layers / n`` (the report says which was run).

Random weights: transformers' own initialisation (normal(0, 0.02)), run on the device, so a
27B-shaped model appears in well under a second and never touches host memory or disk. Our path
builds them through the one model builder (``models/build.py``, ``random_base``:
``transformers_config`` here), exactly as ``fit`` builds a folder's model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn


@dataclass(frozen=True)
class ModelShape:
    name: str
    arch: str  # "qwen3" | "qwen3_5"
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])


SHAPES = {
    "dense8b": ModelShape("dense8b", "qwen3", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, tie_word_embeddings=False,
    )),
    "qwen3_6_27b": ModelShape("qwen3_6_27b", "qwen3_5", dict(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        max_position_embeddings=262144, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    )),
    "tiny": ModelShape("tiny", "qwen3", dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=8192, tie_word_embeddings=False,
    )),
    "tiny_hybrid": ModelShape("tiny_hybrid", "qwen3_5", dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=8192, tie_word_embeddings=False,
    )),
}


def shape_by_name(name: str) -> ModelShape:
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    return SHAPES[name]


def transformers_config(shape: ModelShape, layers: Optional[int] = None):
    """The transformers config of ``shape`` cut to its first ``layers`` decoder layers."""
    config = dict(shape.config)
    if layers is not None:
        if not 1 <= layers <= shape.num_layers:
            raise ValueError(f"layers={layers} must be within 1..{shape.num_layers} for {shape.name}")
        config["num_hidden_layers"] = int(layers)
    if shape.arch == "qwen3":
        from transformers import Qwen3Config as Config
    elif shape.arch == "qwen3_5":
        from transformers.models.qwen3_5 import Qwen3_5TextConfig as Config

        config.setdefault("layer_types", [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(config["num_hidden_layers"])
        ])
    else:
        raise ValueError(f"unknown architecture {shape.arch!r}")
    return Config(**config)


def build_model(
    shape: ModelShape,
    *,
    device: torch.device,
    dtype: torch.dtype,
    attn_implementation: str,
    layers: Optional[int] = None,
    seed: int = 0,
) -> nn.Module:
    """A random ``*ForCausalLM`` of ``shape`` (first ``layers`` layers) on ``device`` in ``dtype``,
    ``use_cache`` off, frozen, in eval mode: ``models.build.load_base``'s random weights, the
    same as the base ``OursRunner`` builds for the same arguments and seed (for the baseline,
    the FLOP count and the written model folders)."""
    from types import SimpleNamespace

    from atlas_lightning.models.build import load_base

    wanted = SimpleNamespace(dtype=dtype, attn_implementation=attn_implementation)
    model = load_base(wanted, device, random_base=transformers_config(shape, layers), seed=seed)
    return model.eval().requires_grad_(False)


def linear_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """``(in, out)`` of every ``nn.Linear`` inside the decoder layers (what all-linear LoRA wraps
    and what the per-token matmul FLOPs count), excluding the output head."""
    out = []
    for layer in model.model.layers:
        for module in layer.modules():
            if isinstance(module, nn.Linear):
                out.append((module.in_features, module.out_features))
    return out
