"""Map the loaded model's parameter names to the names in the base checkpoint's files.

transformers 5 renames weights on load (``conversion_mapping.py``): Qwen3.5/3.6 checkpoints
store ``model.language_model.layers.0...`` and ``Qwen3_5ForCausalLM`` holds
``model.layers.0...``. vLLM's ``load_weights`` wants the checkpoint's names, so merged
weights are named by reversing the conversion the load applied
(``core_model_loading.revert_weight_conversion``, what ``save_pretrained`` uses), then
checked against the keys actually present in the checkpoint's safetensors files.

Only pure renamings are supported; a conversion that fuses or splits tensors (e.g. MoE
expert stacking) makes ``name_map`` return ``None`` with the reason, and the merged-weight
export refuses with it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from torch import nn


def checkpoint_keys(folder: str | Path) -> Optional[set[str]]:
    """Tensor names stored in a Hugging Face folder's safetensors files (None if it has none)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    keys: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            keys.update(handle.keys())
    return keys


def name_map(model: nn.Module, folder: str | Path) -> tuple[Optional[dict[str, str]], str]:
    """``({loaded name: checkpoint name}, "")`` for every parameter of a freshly loaded,
    unwrapped transformers model (tied duplicates appear once, as ``named_parameters`` gives
    them), or ``(None, reason)`` when the names cannot be mapped one to one."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError as err:
        return None, f"this transformers cannot revert its weight conversions ({err})"

    # Distinct zero-size placeholders: a pure renaming hands each one back unchanged, so the
    # reverted dict's values identify which loaded name became which checkpoint name.
    placeholders = {name: torch.empty(0) for name, _ in model.named_parameters()}
    try:
        reverted = revert_weight_conversion(model, dict(placeholders))
    except Exception as err:  # a converter that needs real tensors: not a pure renaming
        return None, f"reverting transformers' weight conversion failed ({type(err).__name__}: {err})"
    by_id = {id(tensor): name for name, tensor in reverted.items()}
    mapping = {}
    for name, placeholder in placeholders.items():
        if id(placeholder) not in by_id:
            return None, f"{name} is fused or split by transformers' weight conversion, not renamed"
        mapping[name] = by_id[id(placeholder)]
    if len(set(mapping.values())) != len(mapping):
        return None, "transformers' weight conversion maps several parameters onto one checkpoint name"
    stored = checkpoint_keys(folder)
    if stored is not None:
        missing = sorted(v for v in mapping.values() if v not in stored)
        if missing:
            return None, f"{len(missing)} parameter names are not in {folder}'s safetensors files, e.g. {missing[0]}"
    return mapping, ""


#: PEFT's prefix of every adapter tensor key of a wrapped model.
PEFT_PREFIX = "base_model.model."


def lora_key_in_checkpoint_names(key: str, names: dict[str, str]) -> str:
    """A PEFT adapter key (``base_model.model.<loaded module>.lora_A.weight``) renamed to the
    base checkpoint's naming through ``names`` (``name_map``'s ``{loaded: checkpoint}``):
    ``base_model.model.model.layers.0.linear_attn.in_proj_qkv.lora_A.weight`` ->
    ``base_model.model.model.language_model.layers.0.linear_attn.in_proj_qkv.lora_A.weight`` for a
    Qwen3.5/3.6 checkpoint. vLLM maps adapter names as it maps the checkpoint's, so an
    image-text architecture applies only adapters named this way (an adapter named as the text
    model is loaded is matched to no module and silently ignored). A key whose module has no
    checkpoint name is kept as it is."""
    module, found, rest = key.removeprefix(PEFT_PREFIX).partition(".lora_")
    stored = names.get(f"{module}.weight") if key.startswith(PEFT_PREFIX) and found else None
    if not stored or not stored.endswith(".weight"):
        return key
    return f"{PEFT_PREFIX}{stored[:-len('.weight')]}.lora_{rest}"
