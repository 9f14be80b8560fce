"""Model shapes the benchmark builds with random weights, straight on the device.

The shapes (``dense8b``, ``qwen3_6_27b``, ``tiny``, ``tiny_hybrid``) are ``planning/named_shapes.py``'s.

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

from atlas_lightning.planning.named_shapes import NAMED_CONFIGS


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


#: The named shapes of ``planning/named_shapes.py`` (one definition, which ``plan`` reads too).
SHAPES = {name: ModelShape(name, model_type, dict(fields)) for name, (model_type, fields) in NAMED_CONFIGS.items()}


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
