"""Adapter folders: PEFT can load what we save; loading refuses what does not fit, by name."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from atlas_lightning.models import adapters as adapters_module
from atlas_lightning.models.adapters import AdapterMismatchError, load_adapter, save_adapter
from atlas_lightning.models.packing import pack_sequences
from atlas_lightning.demo.tiny_causal_lm import save_tiny_causal_lm
from tests.model_builds import actor_critic

LORA = {"rank": 4, "alpha": 8}
PROMPTS = (3, 2, 5)


@pytest.fixture
def packed():
    g = torch.Generator().manual_seed(5)
    return pack_sequences([torch.randint(0, 128, (n,), generator=g) for n in (8, 5, 11)], PROMPTS)


@pytest.fixture
def trained(qwen3_base, randomize):
    model = actor_critic(qwen3_base, LORA, logprob_chunk_tokens=4)
    randomize(model)
    return model


def test_peft_loads_saved_adapters_and_gives_the_same_outputs(trained, qwen3_base, packed, tmp_path):
    for name in ("actor", "critic"):
        folder = save_adapter(trained, name, tmp_path / name / "lora_adapter")
        files = {p.name for p in folder.iterdir()}
        assert files >= {"adapter_config.json", "adapter_model.safetensors", "atlas_base.json"}
    assert (tmp_path / "critic" / "lora_adapter" / "value_head.safetensors").is_file()
    assert not (tmp_path / "actor" / "lora_adapter" / "value_head.safetensors").exists()
    assert not [p for p in tmp_path.rglob(".*")]  # no temporary folders left behind

    with torch.no_grad():
        actor_lp, _ = trained.actor_forward(packed)
        values = trained.critic_forward(packed)
    for name in ("actor", "critic"):
        base = AutoModelForCausalLM.from_pretrained(qwen3_base, dtype=torch.float32)
        peft = PeftModel.from_pretrained(base, str(tmp_path / name / "lora_adapter"))
        seq_outputs = []
        with torch.no_grad():
            for start, end, prompt in zip(packed.cu_seqlens[:-1], packed.cu_seqlens[1:], PROMPTS):
                ids = packed.input_ids[:, start:end]
                out = peft(input_ids=ids, output_hidden_states=True)
                if name == "actor":
                    logp = torch.log_softmax(out.logits[0, prompt - 1 : -1], -1)
                    seq_outputs.append(logp.gather(-1, ids[0, prompt:, None])[:, 0])
                else:
                    head = load_file(str(tmp_path / name / "lora_adapter" / "value_head.safetensors"))
                    hidden = out.hidden_states[-1][0, prompt - 1 : -1]
                    seq_outputs.append(hidden @ head["weight"][0] + head["bias"][0])
        expected = actor_lp if name == "actor" else values
        torch.testing.assert_close(torch.cat(seq_outputs), expected, rtol=1e-5, atol=1e-5)


def test_load_adapter_restores_both_adapters(trained, qwen3_base, packed, tmp_path):
    for name in ("actor", "critic"):
        save_adapter(trained, name, tmp_path / name)
    fresh = actor_critic(qwen3_base, LORA, logprob_chunk_tokens=4, init_seed=99)
    for name in ("actor", "critic"):
        load_adapter(fresh, name, tmp_path / name)
    for p, q in zip(trained.parameters(), fresh.parameters()):
        assert torch.equal(p, q)
    assert all(p.requires_grad for p in fresh.actor_parameters() + fresh.critic_parameters())


def test_save_replaces_an_existing_folder_atomically(trained, tmp_path, monkeypatch):
    folder = tmp_path / "actor"
    save_adapter(trained, "actor", folder)
    first = load_file(str(folder / "adapter_model.safetensors"))
    with torch.no_grad():
        for param in trained.actor_parameters():
            param.add_(1.0)
    save_adapter(trained, "actor", folder)
    second = load_file(str(folder / "adapter_model.safetensors"))
    key = next(k for k in first if "lora_A" in k)
    assert not torch.equal(first[key], second[key])

    # a save that fails half-way leaves the previous folder untouched and no debris
    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_adapter(trained, "actor", folder)
    assert torch.equal(load_file(str(folder / "adapter_model.safetensors"))[key], second[key])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["actor"]


@pytest.mark.parametrize(
    "other_lora, message",
    [
        ({"rank": 8, "alpha": 8}, "r=4 in adapter_config.json, this run's actor adapter has r=8"),
        ({"rank": 4, "alpha": 16}, "lora_alpha=8 in adapter_config.json, this run's actor adapter has lora_alpha=16"),
        ({"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}, "target_modules differ"),
    ],
)
def test_refuses_other_lora_settings(trained, qwen3_base, tmp_path, other_lora, message):
    save_adapter(trained, "actor", tmp_path / "actor")
    other = actor_critic(qwen3_base, other_lora)
    with pytest.raises(AdapterMismatchError, match=message) as err:
        load_adapter(other, "actor", tmp_path / "actor")
    assert str(tmp_path / "actor") in str(err.value)


def test_refuses_a_different_base(trained, tmp_path, tmp_path_factory):
    save_adapter(trained, "actor", tmp_path / "actor")
    wider = save_tiny_causal_lm(tmp_path_factory.mktemp("wider"), hidden_size=96)
    with pytest.raises(AdapterMismatchError, match="config.hidden_size: this base has 96, the adapter's base had 64"):
        load_adapter(actor_critic(str(wider), LORA), "actor", tmp_path / "actor")
    # same architecture and shapes, other weights (e.g. a fine-tune): only the fingerprint tells
    sibling = save_tiny_causal_lm(tmp_path_factory.mktemp("sibling"), seed=5)
    with pytest.raises(AdapterMismatchError, match="fingerprint: .*same shapes, different weights"):
        load_adapter(actor_critic(str(sibling), LORA), "actor", tmp_path / "actor")


def test_base_fingerprint_ignores_load_dtype_and_path(qwen3_base, tmp_path):
    copy_folder = tmp_path / "moved"
    AutoModelForCausalLM.from_pretrained(qwen3_base).save_pretrained(str(copy_folder))
    a = actor_critic(qwen3_base, LORA, dtype="float32").base_identity
    b = actor_critic(str(copy_folder), LORA, dtype="bfloat16").base_identity
    assert a == b


def test_foreign_folder_without_identity_is_checked_by_shapes(trained, tmp_path, tmp_path_factory, caplog):
    save_adapter(trained, "actor", tmp_path / "actor")
    (tmp_path / "actor" / "atlas_base.json").unlink()  # e.g. an adapter exported by verl
    with caplog.at_level(logging.WARNING):
        load_adapter(trained, "actor", tmp_path / "actor")
    assert "checked by tensor shapes only" in caplog.text
    wider = save_tiny_causal_lm(tmp_path_factory.mktemp("wider2"), hidden_size=96)
    with pytest.raises(AdapterMismatchError, match=r"lora_A.weight has shape \(4, 64\), this model's is \(4, 96\)"):
        load_adapter(actor_critic(str(wider), LORA), "actor", tmp_path / "actor")


def test_missing_files_are_named(trained, tmp_path):
    with pytest.raises(FileNotFoundError, match="no adapter_config.json"):
        load_adapter(trained, "actor", tmp_path / "nowhere")
    save_adapter(trained, "critic", tmp_path / "critic")
    (tmp_path / "critic" / "value_head.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no value_head.safetensors"):
        load_adapter(trained, "critic", tmp_path / "critic")
    head_before = trained.value_head.weight.clone()
    load_adapter(trained, "critic", tmp_path / "critic", require_value_head=False)
    assert torch.equal(trained.value_head.weight, head_before)


def test_saved_config_names_the_base_and_is_inference_mode(trained, qwen3_base, tmp_path):
    save_adapter(trained, "critic", tmp_path / "critic")
    config = json.loads((tmp_path / "critic" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == qwen3_base
    assert (config["r"], config["lora_alpha"], config["inference_mode"]) == (4, 8, True)
    assert adapters_module.BASE_FILE == "atlas_base.json"


def test_copies_into_host_buffers_reuse_them_and_write_what_a_fresh_copy_writes(trained, randomize, tmp_path):
    """The step checkpoint's adapters are copied into host buffers kept from one save to the next
    (``HostBuffers``): the second copy goes into the first's memory, and what the first wrote
    before it is what ``save_adapters`` (new host tensors) writes for the same weights."""
    from atlas_lightning.models.adapters import HostBuffers, copy_adapters, save_adapters, write_adapter_copies

    def pointers(copies) -> dict:
        return {(c.name, k): v.data_ptr() for c in copies for k, v in {**c.state, **(c.value_head or {})}.items()}

    def written(kind: str, name: str, file: str) -> dict:
        return load_file(str(tmp_path / kind / name / "lora_adapter" / file))

    buffers = HostBuffers()
    first = copy_adapters(trained, into=buffers)
    write_adapter_copies(first, tmp_path / "reused")
    save_adapters(trained, tmp_path / "fresh")

    randomize(trained, seed=99)  # the next step's update
    second = copy_adapters(trained, into=buffers)
    assert pointers(second) == pointers(first)
    for name, files in (("actor", ["adapter_model.safetensors"]),
                        ("critic", ["adapter_model.safetensors", "value_head.safetensors"])):
        for file in files:
            reused, fresh = written("reused", name, file), written("fresh", name, file)
            assert reused.keys() == fresh.keys() and all(torch.equal(reused[k], fresh[k]) for k in fresh)
    now = {c.name: c.state for c in copy_adapters(trained)}  # new host tensors: the weights after the update
    for copied in second:
        assert all(torch.equal(copied.state[k], now[copied.name][k]) for k in copied.state)
        before = written("reused", copied.name, "adapter_model.safetensors")
        assert not all(torch.equal(copied.state[k], before[k]) for k in copied.state)


def test_the_weight_syncs_exports_reuse_host_buffers_and_each_folder_holds_its_own_weights(trained, randomize,
                                                                                            tmp_path):
    """The weight sync writes each LoRA export from host buffers kept for the run (``save_adapter``
    with ``into``): the second export reuses the first's memory, and each folder holds the weights
    of its moment, as a save into new host tensors writes them."""
    from atlas_lightning.models.adapters import HostBuffers

    buffers = HostBuffers()
    save_adapter(trained, "actor", tmp_path / "first", checkpoint_names=True, into=buffers)
    pointers = {name: t.data_ptr() for name, t in buffers._buffers.items()}
    first = load_file(str(tmp_path / "first" / "adapter_model.safetensors"))
    randomize(trained, seed=7)  # the next update
    save_adapter(trained, "actor", tmp_path / "second", checkpoint_names=True, into=buffers)
    save_adapter(trained, "actor", tmp_path / "fresh", checkpoint_names=True)
    assert {name: t.data_ptr() for name, t in buffers._buffers.items()} == pointers
    second = load_file(str(tmp_path / "second" / "adapter_model.safetensors"))
    fresh = load_file(str(tmp_path / "fresh" / "adapter_model.safetensors"))
    assert second.keys() == fresh.keys() == first.keys()
    assert all(torch.equal(second[k], fresh[k]) for k in fresh)
    assert not all(torch.equal(first[k], second[k]) for k in first)  # the first folder kept its own
