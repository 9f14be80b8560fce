"""Adapter folders are checked against what they say they are before use: damaged files are
refused naming the folder and the file, non-finite weights are refused naming the tensor, and a
critic's folder is never loaded as the actor."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from atlas_lightning.models.adapters import (
    AdapterError,
    AdapterMismatchError,
    load_adapter,
    read_adapter_folder,
    save_adapter,
)
from tests.model_builds import actor_critic

LORA = {"rank": 4, "alpha": 8}


@pytest.fixture(scope="module")
def model(qwen3_base):
    from tests.conftest import randomize_adapters

    built = actor_critic(qwen3_base, LORA, logprob_chunk_tokens=4)
    randomize_adapters(built)
    return built


@pytest.fixture
def saved(model, tmp_path):
    return {role: save_adapter(model, role, tmp_path / role / "lora_adapter") for role in ("actor", "critic")}


def _refused(model, role, folder, error=AdapterError):
    with pytest.raises(error) as info:
        load_adapter(model, role, folder)
    assert str(folder) in str(info.value)
    return str(info.value)


def _params(model, role):
    return {n: p.detach().clone() for n, p in model.named_parameters() if f".{role}." in n}


# -- damaged files -------------------------------------------------------------------------------


@pytest.mark.parametrize("file", ["adapter_model.safetensors", "value_head.safetensors"])
@pytest.mark.parametrize("keep", [0, 7, 100, -1])
def test_empty_or_truncated_safetensors_are_named(model, saved, file, keep):
    path = saved["critic"] / file
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:-1])
    before = _params(model, "critic")
    message = _refused(model, "critic", saved["critic"])
    assert f"{file} is not a readable safetensors file" in message
    assert all(torch.equal(before[n], p) for n, p in _params(model, "critic").items())  # nothing copied


@pytest.mark.parametrize("text, problem", [
    ("", "adapter_config.json is not readable JSON"),
    ("{\"r\": 4,", "adapter_config.json is not readable JSON"),
    ("[1, 2]", "adapter_config.json holds a JSON list, not an object"),
    (b"\xff\xfe{}", "adapter_config.json is not readable JSON"),
])
def test_an_invalid_adapter_config_is_named(model, saved, text, problem):
    path = saved["actor"] / "adapter_config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert problem in _refused(model, "actor", saved["actor"])


@pytest.mark.parametrize("field, value, problem", [
    ("r", None, "field r=None is not a positive integer"),
    ("r", "4", "field r='4' is not a positive integer"),
    ("r", 0, "field r=0 is not a positive integer"),
    ("lora_alpha", float("nan"), "field lora_alpha=nan is not a positive number"),
    ("target_modules", [], "field target_modules=[] names no module"),
    ("peft_type", "IA3", "peft_type='IA3', expected 'LORA'"),
])
def test_adapter_config_fields_are_checked(model, saved, field, value, problem):
    path = saved["actor"] / "adapter_config.json"
    config = json.loads(path.read_text())
    if value is None:
        config.pop(field)
    else:
        config[field] = value
    path.write_text(json.dumps(config))
    assert problem in _refused(model, "actor", saved["actor"])


@pytest.mark.parametrize("damage", ["truncated", "not_object", "no_fingerprint", "bad_role"])
def test_a_damaged_identity_file_is_named(model, saved, damage):
    path = saved["actor"] / "atlas_base.json"
    identity = json.loads(path.read_text())
    if damage == "truncated":
        path.write_text(path.read_text()[:40])
    elif damage == "not_object":
        path.write_text("42")
    elif damage == "no_fingerprint":
        identity.pop("fingerprint")
        path.write_text(json.dumps(identity))
    else:
        identity["adapter_name"] = "policy"
        path.write_text(json.dumps(identity))
    message = _refused(model, "actor", saved["actor"])
    assert "atlas_base.json" in message


# -- what the folder says it is -------------------------------------------------------------------


def test_a_critic_folder_is_not_loaded_as_the_actor(model, saved):
    message = _refused(model, "actor", saved["critic"], AdapterMismatchError)
    assert "its atlas_base.json says it is the critic adapter; refusing to load it as the actor" in message
    # a critic folder from elsewhere (no identity file): its value head says what it is
    (saved["critic"] / "atlas_base.json").unlink()
    message = _refused(model, "actor", saved["critic"], AdapterMismatchError)
    assert "holds value_head.safetensors, so it is a critic adapter" in message


def test_an_actor_folder_is_not_loaded_as_the_critic(model, saved):
    assert "says it is the actor adapter" in _refused(model, "critic", saved["actor"], AdapterMismatchError)


@pytest.mark.parametrize("file", ["adapter_model.safetensors", "value_head.safetensors"])
@pytest.mark.parametrize("poison", ["all_nan", "one_inf"])
def test_non_finite_weights_are_refused_naming_the_tensor(model, saved, file, poison):
    path = saved["critic"] / file
    tensors = load_file(str(path))
    name = sorted(tensors)[-1]
    if poison == "all_nan":
        tensors[name] = torch.full_like(tensors[name], math.nan)
    else:
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[0] = math.inf
    save_file(tensors, str(path))
    count = tensors[name].numel() if poison == "all_nan" else 1
    message = _refused(model, "critic", saved["critic"])
    assert f"{file} tensor {name} holds {count} non-finite value(s) of {tensors[name].numel()}" in message


def test_an_intact_folder_still_loads_and_reads(model, saved):
    data = read_adapter_folder(saved["critic"], "critic")
    assert data.identity["adapter_name"] == "critic" and data.value_head is not None
    load_adapter(model, "critic", saved["critic"])


def test_a_weight_that_is_not_floating_point_is_refused(model, saved):
    path = saved["actor"] / "adapter_model.safetensors"
    tensors = load_file(str(path))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, str(path))
    assert f"tensor {name} is torch.int32, not a floating-point weight" in _refused(model, "actor", saved["actor"])
