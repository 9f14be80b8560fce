"""A PEFT adapter folder against a base, from the files alone (no weight is read): the base it
was trained on (``atlas_base.json``'s config fields against ``model.path``'s ``config.json``) and
its target modules as the base's linear names.

``check_adapter``: a starting adapter's tensors, from the safetensors header, against its own
``adapter_config.json`` and this base.

Who calls it: the pre-flight's adapter check (``run/preflight.py``), the start-up check of the
starting adapters (``run/facts.py``) and of the adapters a resume restores
(``run/resume_adapters.py``). ``ConfigError`` naming the folder.
"""

from __future__ import annotations

import json
import re
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


_LORA_KEY = re.compile(r"layers\.(\d+)\.(?:.*\.)?([A-Za-z0-9_]+)\.lora_([AB])\.weight$")


def check_adapter(cfg, shape, role: str, folder: Path) -> str:
    """One starting adapter against this base (pre-flight's check 4, and ``fit``'s start-up,
    ``run/facts.py``): its LoRA shape is its own
    ``adapter_config.json``'s (the trainer builds the adapter with it), its tensors must have the
    shapes that LoRA and this base imply. Returns the line pre-flight prints: the shape it will
    train, and where ``model.lora`` (or ``model.critic_lora``) says otherwise, that the folder's wins."""
    from atlas_lightning.planning.shapes import safetensors_header
    from atlas_lightning.store.lora_shapes import (AdapterConfigError, config_lora_shape, read_adapter_config,
                                                   shape_from_adapter_config, starting_adapter_source)

    source = starting_adapter_source(cfg, role)
    config_file = folder / "adapter_config.json"
    try:
        saved = read_adapter_config(folder)
        lora = shape_from_adapter_config(saved, str(config_file))
    except AdapterConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
    check_adapter_base(shape, folder, source)

    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise ConfigError(f"{source}: {folder} has no adapter_model.safetensors")
    header = safetensors_header(weights)
    seen, found_modules = 0, set()
    for key, info in header.items():
        match = _LORA_KEY.search(key)
        if not match:
            continue
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        if layer >= shape.num_layers:
            raise ConfigError(f"{source}: {weights} has {key}, but the base has {shape.num_layers} layers")
        linear = {lin.name: lin for lin in shape.linears(shape.layer_types[layer])}.get(module)
        if linear is None:
            raise ConfigError(f"{source}: {weights} has {key}: the base's layer {layer} has no linear {module}")
        rank = _module_rank(lora, key)
        expect = [rank, linear.in_features] if which == "A" else [linear.out_features, rank]
        if list(info.get("shape", [])) != expect:
            raise ConfigError(f"{source}: {weights} {key} has shape {info.get('shape')}, this base and the "
                              f"folder's r={rank} imply {expect} (a different base model, or tensors that do "
                              f"not match their own adapter_config.json)")
        seen += 1
        found_modules.add(module)
    expected_modules = {lin.name for t in set(shape.layer_types) for lin in shape.adapted_linears(t, lora.target_modules)}
    if isinstance(lora.target_modules, str) and lora.target_modules != "all-linear":
        expected_modules = found_modules  # a regex: peft matches it on full names; the tensors say what it matched
    if found_modules != expected_modules:
        raise ConfigError(f"{source}: {weights} adapts {sorted(found_modules)}, its adapter_config.json's "
                          f"target_modules={saved.get('target_modules')!r} mean {sorted(expected_modules)} on this base")
    count = 2 * sum(len(shape.adapted_linears(t, sorted(found_modules))) for t in shape.layer_types)
    if seen != count and not saved.get("layers_to_transform"):
        raise ConfigError(f"{source}: {weights} holds {seen} LoRA tensors, this base and target modules need {count}")
    head = _check_value_head(shape, folder, saved, header, source) if role == "critic" else ""
    line = f"{role} {folder}: {lora.describe()}, {seen} tensors{head}"
    configured = config_lora_shape(cfg, role)
    if ((configured.rank, configured.alpha, target_names(configured, shape))
            != (lora.rank, lora.alpha, target_names(lora, shape))):
        line += f" (the folder's shape; {configured.source} says {configured.describe()})"
    return line


def _module_rank(lora, key: str) -> int:
    """The rank peft gives the module of ``key``: ``rank_pattern``'s (a key matching the module
    path's end, as peft matches it) or the adapter's ``r``."""
    module = key.split(".lora_")[0]
    for pattern, rank in lora.rank_pattern.items():
        if re.search(rf"(^|\.){pattern}$", module):
            return int(rank)
    return lora.rank


def _check_value_head(shape, folder: Path, saved: dict, header: dict, source: str) -> str:
    """The critic's value head: ``value_head.safetensors``, or a ``(1, hidden)`` module among
    ``modules_to_save`` inside ``adapter_model.safetensors`` (what ``models/adapters.py`` loads)."""
    from atlas_lightning.planning.shapes import safetensors_header

    head = folder / "value_head.safetensors"
    if head.is_file():
        shapes = {k: v.get("shape") for k, v in safetensors_header(head).items()}
        if shapes.get("weight") != [1, shape.hidden_size]:
            raise ConfigError(f"{source}: {head} weight has shape {shapes.get('weight')}, expected "
                              f"[1, {shape.hidden_size}]")
        return ""
    names = saved.get("modules_to_save") or []
    names = {str(n).split(".")[-1] for n in ([names] if isinstance(names, str) else names)}
    weights = {k: v.get("shape") for k, v in header.items()
               if ".lora_" not in k and k.rpartition(".")[0].split(".")[-1] in names and k.endswith(".weight")}
    if not weights:
        raise ConfigError(f"{source}: {folder} has no value_head.safetensors and no value head among "
                          f"adapter_config.json's modules_to_save (the critic's value head)")
    if len(weights) != 1 or next(iter(weights.values())) != [1, shape.hidden_size]:
        raise ConfigError(f"{source}: {folder}'s modules_to_save hold {weights}; a value head is a weight "
                          f"[1, {shape.hidden_size}]")
    return f", value head {next(iter(weights))} (modules_to_save)"
