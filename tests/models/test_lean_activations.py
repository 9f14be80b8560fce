"""Lean saved activations (``models/lean_activations.py``): the forward is bit-identical to
transformers', the gradients are the plain model's, and the backward holds fewer saved bytes."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from atlas_lightning.config import LoraConfig
from atlas_lightning.models.lean_activations import RMSNormFunction
from atlas_lightning.models.packing import pack_sequences
from tests.model_builds import actor_critic

LORA = LoraConfig(rank=4, alpha=8, dropout=0.0, target_modules="all-linear")
LENGTHS, PROMPTS = (9, 4, 13, 6), (3, 2, 5, 1)
#: Saved bytes of a lean actor + critic pass at most this share of the plain one's (2-layer
#: tiny bases, so log-prob chunks and the residual stream weigh more than at scale; the hybrid's
#: reference Gated DeltaNet code saves much that no norm or MLP holds).
MAX_SAVED_RATIO = {("qwen3_base", 0): 0.8, ("qwen3_base", 1): 0.85, ("qwen3_5_base", 0): 0.95, ("qwen3_5_base", 1): 0.85}


def _batch(vocab=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, vocab, (n,), generator=g) for n in LENGTHS]
    return pack_sequences(sequences, PROMPTS)


def _losses_and_grads(model, packed):
    model.zero_grad(set_to_none=True)
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with saved_tensors_hooks(pack, lambda tensor: tensor):
        log_probs, entropy = model.actor_forward(packed)
        values = model.critic_forward(packed)
    loss = -(log_probs * torch.linspace(0.5, 1.5, log_probs.numel())).mean() + entropy.mean() * 0.1 + values.pow(2).mean()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return (log_probs.detach(), entropy.detach(), values.detach()), grads, sum(saved)


@pytest.mark.parametrize("base_name", ["qwen3_base", "qwen3_5_base"])
@pytest.mark.parametrize("checkpoint_layers", [0, 1])
def test_lean_layers_match_the_plain_model_with_fewer_saved_bytes(base_name, checkpoint_layers, request, randomize):
    base = request.getfixturevalue(base_name)
    runs = {}
    for lean in (False, True):
        model = actor_critic(base, LORA, logprob_chunk_tokens=5, gradient_checkpointing=True,
                            checkpoint_layers=checkpoint_layers, lean_activations=lean)
        randomize(model)
        runs[lean] = _losses_and_grads(model, _batch())
    (plain_out, plain_grads, plain_bytes), (lean_out, lean_grads, lean_bytes) = runs[False], runs[True]
    for a, b in zip(plain_out, lean_out):
        assert torch.equal(a, b)  # the forward runs the same ops
    assert sorted(plain_grads) == sorted(lean_grads) and len(plain_grads) > 0
    for name, grad in plain_grads.items():
        torch.testing.assert_close(lean_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    print(f"saved bytes: lean {lean_bytes}, plain {plain_bytes}, ratio {lean_bytes / plain_bytes:.3f}")
    assert lean_bytes < MAX_SAVED_RATIO[base_name, checkpoint_layers] * plain_bytes, (lean_bytes, plain_bytes)
    # * plain_bytes, (lean_bytes, plain_bytes)


@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_function_against_autograd(offset, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 3, 16, generator=g) * 3).to(dtype).requires_grad_(True)
    weight = (torch.randn(16, generator=g) * 0.5 + (0.0 if offset else 1.0)).to(dtype).requires_grad_(True)
    eps = 1e-6

    def reference(x, w):  # transformers' Qwen3RMSNorm / Qwen3_5RMSNorm forwards
        x_f = x.float()
        normed = x_f * torch.rsqrt(x_f.pow(2).mean(-1, keepdim=True) + eps)
        return (normed * (1.0 + w.float())).to(x.dtype) if offset else w * normed.to(x.dtype)

    grad_y = torch.randn(5, 3, 16, generator=g).to(dtype)
    y_ref = reference(x, weight)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (x, weight), grad_y)
    y = RMSNormFunction.apply(x, weight, eps, offset)
    dx, dw = torch.autograd.grad(y, (x, weight), grad_y)
    assert torch.equal(y, y_ref)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dx, dx_ref, **tol)
    torch.testing.assert_close(dw, dw_ref, **tol)
