"""Recomputation finer than a layer (``models/recompute.py``): the SwiGLU tail function gives
autograd's gradients, and checkpointing only the token mixers keeps the forward and the
gradients while saving fewer bytes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks

from atlas_lightning.config import LoraConfig
from atlas_lightning.models.actor_critic import ActorCritic
from atlas_lightning.models.packing import pack_sequences
from atlas_lightning.models.recompute import SwiGLUDownFunction

LORA = LoraConfig(rank=4, alpha=8, dropout=0.0, target_modules="all-linear")
LENGTHS, PROMPTS = (9, 4, 13, 6), (3, 2, 5, 1)


@pytest.mark.parametrize("lora", [True, False])
def test_swiglu_down_against_autograd(lora):
    g = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(2, 7, 24, generator=g).requires_grad_(True) for _ in range(2))
    weight = torch.randn(16, 24, generator=g)
    a = torch.randn(4, 24, generator=g).requires_grad_(True) if lora else None
    b = torch.randn(16, 4, generator=g).requires_grad_(True) if lora else None
    grad_y = torch.randn(2, 7, 16, generator=g)

    h = F.silu(gate) * up  # what transformers' MLP and peft's LoRA linear compute, as separate nodes
    reference = F.linear(h, weight) + (0.5 * F.linear(F.linear(h, a), b) if lora else 0)
    inputs = (gate, up, a, b) if lora else (gate, up)
    expected = torch.autograd.grad(reference, inputs, grad_y)
    got_y = SwiGLUDownFunction.apply(gate, up, weight, a, b, 0.5)
    got = torch.autograd.grad(got_y, inputs, grad_y)
    torch.testing.assert_close(got_y, reference, rtol=1e-5, atol=1e-5)
    for x, y in zip(got, expected):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def _run(model, packed):
    model.zero_grad(set_to_none=True)
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with saved_tensors_hooks(pack, lambda tensor: tensor):
        log_probs, _ = model.actor_forward(packed)
        values = model.critic_forward(packed)
    (-(log_probs * torch.linspace(0.5, 1.5, log_probs.numel())).mean() + values.pow(2).mean()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return (log_probs.detach(), values.detach()), grads, sum(saved)


@pytest.mark.parametrize("base_name", ["qwen3_base", "qwen3_5_base"])
def test_mixer_checkpoints_keep_forward_and_gradients_with_fewer_saved_bytes(base_name, request, randomize):
    base = request.getfixturevalue(base_name)
    g = torch.Generator().manual_seed(0)
    packed = pack_sequences([torch.randint(0, 128, (n,), generator=g) for n in LENGTHS], PROMPTS)
    runs = {}
    for mixers in (0, 2):
        model = ActorCritic(base, LORA, logprob_chunk_tokens=5, gradient_checkpointing=True, checkpoint_layers=0,
                            checkpoint_mixers=mixers)
        assert model.checkpointed_mixers == mixers
        randomize(model)
        runs[mixers] = _run(model, packed)
    (out0, grads0, bytes0), (out2, grads2, bytes2) = runs[0], runs[2]
    for a, b in zip(out0, out2):
        assert torch.equal(a, b)  # the same ops run forward
    assert sorted(grads0) == sorted(grads2) and len(grads0) > 0
    for name, grad in grads0.items():
        torch.testing.assert_close(grads2[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    print(f"saved bytes: mixers checkpointed {bytes2}, not {bytes0}")
    assert bytes2 < 0.9 * bytes0


def test_mixer_checkpoints_are_bounded_by_the_layers_left(qwen3_base):
    with pytest.raises(ValueError, match="checkpoint_mixers=2 needs gradient_checkpointing=True and at most 1"):
        ActorCritic(qwen3_base, LORA, gradient_checkpointing=True, checkpoint_layers=1, checkpoint_mixers=2)
