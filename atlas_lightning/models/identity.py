"""What identifies a base model, so an adapter is never started on a base it was not trained on.

A path string says nothing (ATLAS report 28, the report this project reproduces, moved
adapters between machines whose base folders lie at different paths), and a config can be shared by two different checkpoints of one
architecture (the base and a fine-tune of it). The identity therefore has two parts:

* ``config``: architecture and the shape fields (``hidden_size``, layers, heads, vocabulary,
  ...) read from the model's config; a mismatch is named field by field.
* ``fingerprint``: sha256 over every parameter's name and shape and over the values of a few
  parameters (the first ``SAMPLE_ELEMENTS`` of the first, middle and last parameter), taken
  in bf16 so that the same checkpoint loaded in bf16 or fp32 gives the same fingerprint.

It is computed once, when ``ActorCritic`` loads the base (before LoRA and sharding), and is
written beside each saved adapter as ``atlas_base.json``.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

SAMPLE_ELEMENTS = 65536

#: Config fields compared between bases; absent fields are skipped.
SHAPE_FIELDS = (
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "layer_types", "linear_num_key_heads",
    "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "tie_word_embeddings",
)


def base_identity(model: nn.Module) -> dict[str, Any]:
    """``{"architectures", "config": {field: value}, "fingerprint"}`` of a transformers causal LM
    whose parameters are plain (unsharded) tensors. Collective-free; call before sharding."""
    config = model.config
    params = list(model.named_parameters())
    fingerprint = _fingerprint([(name, tuple(param.shape)) for name, param in params],
                               lambda index: params[index][1].detach().reshape(-1)[:SAMPLE_ELEMENTS])
    fields = {}
    for field in SHAPE_FIELDS:
        if hasattr(config, field):
            value = getattr(config, field)
            fields[field] = list(value) if isinstance(value, (list, tuple)) else value
    return {
        "architectures": list(getattr(config, "architectures", None) or [type(model).__name__]),
        "config": fields,
        "fingerprint": fingerprint,
    }


def _fingerprint(shapes: list[tuple[str, tuple]], sample: Callable[[int], Optional[torch.Tensor]]) -> Optional[str]:
    """The module doc's ``fingerprint`` of parameters named and shaped as ``shapes``, ``sample(i)``
    giving the first ``SAMPLE_ELEMENTS`` values of the ``i``-th (None: not to be had)."""
    digest = hashlib.sha256()
    for name, shape in shapes:
        digest.update(f"{name}:{shape};".encode())
    for index in sorted({0, len(shapes) // 2, len(shapes) - 1}):
        values = sample(index)
        if values is None:
            return None
        digest.update(values.to(device="cpu", dtype=torch.bfloat16).view(torch.int16).numpy().tobytes())
    return digest.hexdigest()


def folder_fingerprint(model: nn.Module, folder: str | Path) -> Optional[str]:
    """``base_identity``'s fingerprint of the base ``folder`` holds, without loading it: names and
    shapes from ``model`` (the folder's architecture, built on the meta device), the sampled
    values read from the folder's safetensors where it stores them under the parameter's own
    name. None where it does not (a checkpoint layout transformers renames on load, as
    Qwen3.5's ``model.language_model.*``): the build computes it then."""
    from safetensors import safe_open

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = json.loads(index.read_text()).get("weight_map", {}) if index.is_file() else {}
    params = list(model.named_parameters())

    def sample(position: int) -> Optional[torch.Tensor]:
        name = params[position][0]
        file = folder / files.get(name, "model.safetensors")
        if not file.is_file():
            return None
        with safe_open(str(file), framework="pt") as handle:
            if name not in handle.keys():
                return None
            part = handle.get_slice(name)
            shape = part.get_shape()
            rows = -(-SAMPLE_ELEMENTS // max(1, math.prod(shape[1:]))) if len(shape) > 1 else SAMPLE_ELEMENTS
            return part[:rows].reshape(-1)[:SAMPLE_ELEMENTS]

    return _fingerprint([(name, tuple(param.shape)) for name, param in params], sample)


def identity_mismatch(expected: dict[str, Any], found: dict[str, Any]) -> str | None:
    """The first difference between two identities, as ``field: expected X, found Y``; None if equal."""
    for field in sorted(set(expected["config"]) | set(found.get("config", {}))):
        a, b = expected["config"].get(field), found.get("config", {}).get(field)
        if a != b:
            return f"config.{field}: this base has {a!r}, the adapter's base had {b!r}"
    if expected.get("fingerprint") != found.get("fingerprint"):
        return (
            f"fingerprint: this base's weights hash to {expected.get('fingerprint')}, the adapter's base to "
            f"{found.get('fingerprint')} (same shapes, different weights)"
        )
    return None
