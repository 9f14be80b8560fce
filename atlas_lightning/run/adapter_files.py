"""A PEFT adapter folder against a base, from the files alone (no weight is read): the base it
was trained on (``atlas_base.json``'s config fields against ``model.path``'s ``config.json``) and
its target modules as the base's linear names.

Who calls it: the pre-flight's adapter check (``run/preflight.py``) and the start-up check of the
adapters a resume restores (``run/resume_adapters.py``). ``ConfigError`` naming the folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from atlas_lightning.config import ConfigError


def target_names(lora, shape) -> Any:
    """``lora.target_modules`` (a ``LoraShape``'s) as a sorted tuple of this base's linear names
    (``all-linear`` expanded; ``shape``: ``planning.shapes.read_model_shape``'s); a regex as it is."""
    if lora.target_modules == "all-linear":
        return tuple(sorted(shape.linear_names()))
    return lora.target_modules if isinstance(lora.target_modules, str) else tuple(sorted(lora.target_modules))


def check_adapter_base(shape, folder: Path, source: str) -> None:
    """``atlas_base.json``'s config fields against this base's ``config.json`` (shared fields
    only); a folder without one passes (an adapter from elsewhere: its tensor shapes are the
    check). ``source``: the key that names the folder, for the message."""
    identity_file = folder / "atlas_base.json"
    if not identity_file.is_file():
        return
    from atlas_lightning.models.identity import SHAPE_FIELDS
    from atlas_lightning.store.files import read_json_object

    theirs = read_json_object(identity_file, ConfigError, f"{source}: {folder}").get("config")
    theirs = theirs if isinstance(theirs, dict) else {}
    mine = _base_config_fields(shape)
    for key in SHAPE_FIELDS:
        if key in theirs and key in mine and _normal(key, theirs[key]) != _normal(key, mine[key]):
            raise ConfigError(f"{source}: {folder} was trained on a different base: {key} is {theirs[key]!r} "
                              f"there, {mine[key]!r} in model.path's config.json")


def _normal(key: str, value: Any) -> Any:
    if key == "model_type" and isinstance(value, str):
        return value.removesuffix("_text")
    return list(value) if isinstance(value, (list, tuple)) else value


def _base_config_fields(shape) -> dict[str, Any]:
    raw = json.loads(Path(shape.source).read_text())
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    return {**text, "model_type": text.get("model_type", raw.get("model_type")),
            "tie_word_embeddings": raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))}
