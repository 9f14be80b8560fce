"""Merged weights for the engines (one process; the FSDP2 world sizes are in
test_fsdp_multiprocess.py): the fused merge against a float64 reference of the same formula and
against peft's own merge, checkpoint names, buckets."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import get_peft_model_state_dict
from transformers import AutoModelForCausalLM

from atlas_lightning.models.actor_critic import ActorCritic
from atlas_lightning.models.checkpoint_names import checkpoint_keys
from atlas_lightning.models.merge_kernel import rounding_bound
from atlas_lightning.models.packing import pack_sequences
from atlas_lightning.models.weights import adapter_state, bucket_weights, merged_weight_buckets, merged_weights
from tests.model_builds import actor_critic

LORA = {"rank": 4, "alpha": 8}


def _peft_merge(model: ActorCritic, adapter: str) -> dict[str, torch.Tensor]:
    peft_copy = copy.deepcopy(model.peft_model)
    peft_copy.set_adapter(adapter)
    merged = peft_copy.merge_and_unload().state_dict()
    names = model.checkpoint_names
    return {names[k]: v for k, v in merged.items() if k in names}


def _float64_merge(model: ActorCritic, adapter: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per merged weight: the exact ``W + (s * B) @ A`` (factors rounded to W's dtype) in float64
    and the error a correct merge may carry (``merge_kernel.rounding_bound``: one rounding to W's
    dtype plus the fp32 accumulation's)."""
    expected = {}
    for name, module in model.hf_model.named_modules():
        if hasattr(module, "lora_A") and adapter in module.lora_A:
            expected[model.checkpoint_names[f"{name}.weight"]] = rounding_bound(
                module.get_base_layer().weight.detach(), module.lora_B[adapter].weight.detach(),
                module.lora_A[adapter].weight.detach(), module.scaling[adapter])
    return expected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("base_name", ["qwen3_base", "qwen3_tied_base", "qwen3_5_base"])
def test_merged_is_the_rounded_sum_and_agrees_with_peft(base_name, dtype, request, randomize):
    base = request.getfixturevalue(base_name)
    model = actor_critic(base, LORA, dtype=dtype)
    randomize(model)
    for adapter in ("actor", "critic"):
        got = dict(merged_weights(model, adapter))
        peft_merged = _peft_merge(model, adapter)
        assert sorted(got) == sorted(peft_merged)
        reference = _float64_merge(model, adapter)
        assert len(reference) >= 7  # every LoRA-wrapped linear of a layer at least
        for name, tensor in peft_merged.items():
            assert got[name].dtype == tensor.dtype == getattr(torch, dtype), name
            if name in reference:  # merged: the exact sum, rounded once
                exact, bound = reference[name]
                assert bool(((got[name].double() - exact).abs() <= bound).all()), name
                torch.testing.assert_close(got[name], tensor, rtol=(1e-5 if dtype == "float32" else 2e-2),
                                           atol=(1e-6 if dtype == "float32" else 1e-3), msg=name)
            else:  # not LoRA-wrapped: the base tensor itself
                assert torch.equal(got[name], tensor), name
    # names are the checkpoint's own, every one of them (tied duplicates appear once)
    stored = checkpoint_keys(base)
    assert set(got) <= stored
    text_keys = {k for k in stored if not k.startswith(("model.visual.", "mtp."))}
    assert set(got) == text_keys


def test_qwen3_5_names_are_the_vlm_checkpoint_names(qwen3_5_base):
    names = [name for name, _ in merged_weights(actor_critic(qwen3_5_base, LORA))]
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in names
    assert "model.language_model.layers.1.self_attn.q_proj.weight" in names
    assert not any(".base_layer." in n or "lora_" in n for n in names)


def test_merged_weights_reproduce_the_actor_in_a_plain_model(qwen3_base, randomize):
    model = actor_critic(qwen3_base, LORA)
    randomize(model)
    plain = AutoModelForCausalLM.from_pretrained(qwen3_base, dtype=torch.float32)
    plain.load_state_dict(dict(merged_weights(model, "actor")), strict=True)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 128, (n,), generator=g) for n in (7, 10)]
    packed = pack_sequences(seqs, [2, 4])
    with torch.no_grad():
        log_probs, _ = model.actor_forward(packed)
        expected = []
        for seq, prompt in zip(seqs, (2, 4)):
            logits = plain(input_ids=seq[None]).logits[0, prompt - 1 : -1]
            expected.append(torch.log_softmax(logits, -1).gather(-1, seq[prompt:, None])[:, 0])
    torch.testing.assert_close(log_probs, torch.cat(expected), rtol=1e-5, atol=1e-5)


def test_adapter_state_is_peft_named_and_full(qwen3_base, randomize):
    model = actor_critic(qwen3_base, LORA)
    randomize(model)
    for adapter in ("actor", "critic"):
        state = adapter_state(model, adapter)
        expected = get_peft_model_state_dict(model.peft_model, adapter_name=adapter)
        assert sorted(state) == sorted(expected)
        assert all(torch.equal(state[k], expected[k]) for k in state)
        assert all(".actor." not in k and ".critic." not in k for k in state)
    with pytest.raises(ValueError, match="adapter_name='reference'"):
        adapter_state(model, "reference")


def _pairs(*sizes):
    return [(f"w{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate(sizes)]  # 4 bytes per element


def test_buckets_respect_the_cap_keep_order_and_send_big_tensors_alone():
    pairs = _pairs(10, 10, 5, 40, 3, 3, 26)
    buckets = list(bucket_weights(pairs, bucket_bytes=100))
    assert [[name for name, _ in b] for b in buckets] == [["w0", "w1", "w2"], ["w3"], ["w4", "w5"], ["w6"]]
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= 100 or len(bucket) == 1
    assert [name for b in buckets for name, _ in b] == [name for name, _ in pairs]
    assert list(bucket_weights([], 100)) == []
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        list(bucket_weights(pairs, 0))


def test_merged_weight_buckets_cover_every_tensor(qwen3_base):
    model = actor_critic(qwen3_base, LORA)
    flat = [name for name, _ in merged_weights(model)]
    buckets = list(merged_weight_buckets(model, "actor", bucket_bytes=40_000))
    assert [name for b in buckets for name, _ in b] == flat
    assert len(buckets) > 1
