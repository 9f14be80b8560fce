"""Model shapes the benchmark builds with random weights, straight on the device.

The shapes (``dense8b``, ``qwen3_6_27b``, ``tiny``, ``tiny_hybrid``) are ``planning/named_shapes.py``'s.

``layers`` cuts the decoder to its first ``n`` layers (the hybrid keeps its 3:1 pattern when
``n`` is a multiple of 4): per-layer cost and MFU are what a shorter stack measures; tokens a
second scale by ``full layers / n`` (the report says which was run).

Random weights: transformers' own initialisation (normal(0, 0.02)), run on the device, so a
27B-shaped model appears in well under a second and never touches host memory or disk. Our path
builds them through the one model builder (``models/build.py``, ``random_base``:
``transformers_config`` here), exactly as ``fit`` builds a folder's model.

Checkpoint folders (``checkpoint_config``, ``build_checkpoint_model``; the step benchmark's
``--build``): a shape written as its real checkpoints are. Qwen3.5/3.6 checkpoints are image-text
models, ``Qwen3_5ForConditionalGeneration`` with a ``Qwen3_5Config`` (``text_config`` and
``vision_config``): the text model under ``model.language_model.*`` beside a vision tower under
``model.visual.*`` (``VISION_TOWERS``), which is what vLLM requires of that architecture. The
trainer reads the text model alone (``AutoModelForCausalLM``); the engine skips the tower
(``rollout/engines/args.py``: ``language_model_only``).
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


#: The vision tower each image-text shape's checkpoint carries (``Qwen3_5VisionConfig`` fields):
#: Qwen3.6-27B's (27 blocks of width 1152, patches of 16, into the text width 5120; about 0.46B
#: parameters, 0.9 GB in bf16), and a toy one for CPU tests.
VISION_TOWERS: dict[str, dict[str, Any]] = {
    "qwen3_6_27b": dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                        spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                        out_hidden_size=5120),
    "tiny_hybrid": dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                        spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64),
}
#: Rotary fields real checkpoints carry for image-text positions: text tokens get the same position
#: on all three axes, so their rotation equals plain rotary; written so that engine and trainer
#: take the checkpoint's own (multimodal rotary) path.
MROPE: dict[str, dict[str, Any]] = {"qwen3_6_27b": {"mrope_section": [11, 11, 10], "mrope_interleaved": True}}


def checkpoint_config(shape: ModelShape, layers: Optional[int] = None):
    """The config a checkpoint folder of ``shape`` holds (first ``layers`` decoder layers): the text
    config itself for ``qwen3``; for ``qwen3_5`` a ``Qwen3_5Config`` (architecture
    ``Qwen3_5ForConditionalGeneration``) with it as ``text_config`` and ``VISION_TOWERS[name]``
    as ``vision_config`` (module doc). ``ValueError`` for an image-text shape without a tower."""
    text = transformers_config(shape, layers)
    if shape.arch != "qwen3_5":
        return text
    if shape.name not in VISION_TOWERS:
        raise ValueError(f"shape {shape.name} has no vision tower for its checkpoint (bench/shapes.py VISION_TOWERS)")
    from transformers.models.qwen3_5 import Qwen3_5Config

    fields = text.to_dict()
    fields["rope_parameters"] = {**fields.get("rope_parameters", {}), **MROPE.get(shape.name, {})}
    fields["use_cache"] = True
    config = Qwen3_5Config(text_config=fields, vision_config=dict(VISION_TOWERS[shape.name]),
                           tie_word_embeddings=text.tie_word_embeddings)
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    return config


def build_checkpoint_model(shape: ModelShape, *, device: torch.device, dtype: torch.dtype,
                           layers: Optional[int] = None, seed: int = 0) -> nn.Module:
    """A random model of ``checkpoint_config(shape, layers)`` on ``device`` in ``dtype``, as its
    checkpoints are (``save_pretrained`` writes their names): ``build_model``'s ``*ForCausalLM``
    for ``qwen3``; the image-text model (text model and vision tower, transformers' own
    initialisation after ``torch.manual_seed(seed)``) for ``qwen3_5``."""
    if shape.arch != "qwen3_5":
        model = build_model(shape, device=device, dtype=dtype, attn_implementation="sdpa", layers=layers, seed=seed)
        model.config.use_cache = True
        return model
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(checkpoint_config(shape, layers), dtype=dtype,
                                                        attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


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
