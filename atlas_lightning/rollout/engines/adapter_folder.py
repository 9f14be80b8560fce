"""A PEFT LoRA folder as the engines read it, checked before they do.

- ``check_adapter_folder(folder)``: every ``lora_A`` of the folder's safetensors has its
  ``lora_B`` and the reverse (read from the header: no tensor data is loaded), so that vLLM
  never fails on it with a bare ``TypeError``;
- ``adapter_folder_digest(folder)``: the exact digest of the folder as written
  (``digest.lora_digest`` with no dtype or scaling): what the weight sync's export sent, tensor
  for tensor.

Both raise ``EngineError`` naming the folder (and the tensor, for a factor without its partner).

Who calls it: the in-process engine (``vllm_engine.set_adapter``), the server client
(``server_engine.set_adapter``, whose report is this digest) and the weight sync
(``rollout/sync.py``: the exported folder against what the trainer sent, before any engine reads it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from atlas_lightning.errors import quoted
from atlas_lightning.rollout.digest import WeightDigest, lora_digest, lora_modules
from atlas_lightning.rollout.engine import EngineError

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def check_adapter_folder(folder: str | Path) -> None:
    """``EngineError`` naming the folder and the tensor when a LoRA factor of its safetensors
    lacks its partner, or when the file cannot be read."""
    from safetensors import safe_open

    path = Path(folder) / WEIGHTS_FILE
    try:
        with safe_open(str(path), framework="pt") as handle:
            keys = set(handle.keys())
    except Exception as err:  # a missing or damaged file, named
        raise EngineError(f"adapter folder {folder}: {path.name} is not readable "
                          f"({quoted(f'{type(err).__name__}: {err}')})") from err
    for key in sorted(keys):
        for mine, other in ((".lora_A.", ".lora_B."), (".lora_B.", ".lora_A.")):
            if mine in key and key.replace(mine, other) not in keys:
                raise EngineError(f"adapter folder {folder}: {key.replace(mine, other)} is missing from {path.name} "
                                  f"(its partner {key} is there); refusing to load it")


def adapter_folder_digest(folder: str | Path, device: Any = "cpu") -> WeightDigest:
    """The digest of a PEFT LoRA folder as written (module doc), its tensors read onto ``device``
    (the digest is the same on any device; a card computes it in a fraction of the host's time)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    weights, config_path = folder / WEIGHTS_FILE, folder / CONFIG_FILE
    if not weights.is_file() or not config_path.is_file():
        raise EngineError(f"adapter folder {folder}: no {CONFIG_FILE} and {WEIGHTS_FILE} there")
    check_adapter_folder(folder)
    try:
        state = load_file(str(weights), device=str(device))
    except Exception as err:  # safetensors' own error types, named
        raise EngineError(f"adapter folder {folder}: unreadable ({quoted(f'{type(err).__name__}: {err}')})") from err
    try:
        modules = lora_modules(state, 1.0)
    except ValueError as err:
        raise EngineError(f"adapter folder {folder}: {err}") from None
    if not modules:
        raise EngineError(f"adapter folder {folder}: no LoRA tensors in {weights.name}")
    return lora_digest(modules)
