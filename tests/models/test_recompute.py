"""Recomputation finer than a layer (``models/recompute.py``): the SwiGLU functions give
autograd's gradients, and each per-layer policy keeps the forward and the gradients of the
plain model while saving fewer bytes.

The functions are checked in float64: they reorder the sums autograd does, so in float32 an element
that cancels to near zero differs by float32's rounding of its terms (gradients here reach ~2,000,
so ~2e-4), not by a mistake. In float64 that noise is ~1e-12, far below the bound."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks

from atlas_lightning.config import LoraConfig
from atlas_lightning.models.packing import pack_sequences
from atlas_lightning.models.recompute import SwiGLUDownFunction, SwiGLUMLPFunction
from tests.model_builds import actor_critic

LORA = LoraConfig(rank=4, alpha=8, dropout=0.0, target_modules="all-linear")
LENGTHS, PROMPTS = (9, 4, 13, 6), (3, 2, 5, 1)
F64 = torch.float64
FLOAT64_CLOSE = dict(rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("lora", [True, False])
def test_swiglu_down_against_autograd(lora):
    g = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(2, 7, 24, generator=g, dtype=F64).requires_grad_(True) for _ in range(2))
    weight = torch.randn(16, 24, generator=g, dtype=F64)
    a = torch.randn(4, 24, generator=g, dtype=F64).requires_grad_(True) if lora else None
    b = torch.randn(16, 4, generator=g, dtype=F64).requires_grad_(True) if lora else None
    grad_y = torch.randn(2, 7, 16, generator=g, dtype=F64)

    h = F.silu(gate) * up  # what transformers' MLP and peft's LoRA linear compute, as separate nodes
    reference = F.linear(h, weight) + (0.5 * F.linear(F.linear(h, a), b) if lora else 0)
    inputs = (gate, up, a, b) if lora else (gate, up)
    expected = torch.autograd.grad(reference, inputs, grad_y)
    got_y = SwiGLUDownFunction.apply(gate, up, weight, a, b, 0.5)
    got = torch.autograd.grad(got_y, inputs, grad_y)
    torch.testing.assert_close(got_y, reference, **FLOAT64_CLOSE)
    for x, y in zip(got, expected):
        torch.testing.assert_close(x, y, **FLOAT64_CLOSE)


@pytest.mark.parametrize("lora", [True, False])
def test_swiglu_mlp_against_autograd(lora):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 16, generator=g, dtype=F64).requires_grad_(True)
    weights = [torch.randn(*shape, generator=g, dtype=F64) for shape in ((24, 16), (24, 16), (16, 24))]
    loras = [(torch.randn(4, w.shape[1], generator=g, dtype=F64).requires_grad_(True),
              torch.randn(w.shape[0], 4, generator=g, dtype=F64).requires_grad_(True)) if lora else (None, None)
             for w in weights]
    scalings = (0.5, 2.0, 0.25)

    def linear(v, i):
        a, b = loras[i]
        out = F.linear(v, weights[i])
        return out + scalings[i] * F.linear(F.linear(v, a), b) if lora else out

    reference = linear(F.silu(linear(x, 0)) * linear(x, 1), 2)
    inputs = [x] + [t for pair in loras for t in pair if t is not None]
    grad_y = torch.randn(reference.shape, generator=g, dtype=F64)
    expected = torch.autograd.grad(reference, inputs, grad_y)
    flat = [t for w, (a, b) in zip(weights, loras) for t in (w, a, b)]
    got_y = SwiGLUMLPFunction.apply(x, *flat, *scalings)
    got = torch.autograd.grad(got_y, inputs, grad_y)
    torch.testing.assert_close(got_y, reference, **FLOAT64_CLOSE)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, **FLOAT64_CLOSE)


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
@pytest.mark.parametrize("policy", ["mixer", "mlp"])
def test_finer_policies_keep_forward_and_gradients_with_fewer_saved_bytes(base_name, policy, request, randomize):
    base = request.getfixturevalue(base_name)
    g = torch.Generator().manual_seed(0)
    packed = pack_sequences([torch.randint(0, 128, (n,), generator=g) for n in LENGTHS], PROMPTS)
    runs = {}
    for plan in (["none", "none"], [policy, policy]):
        model = actor_critic(base, LORA, logprob_chunk_tokens=5, gradient_checkpointing=True, layer_recompute=plan)
        assert model.layer_recompute == plan and model.checkpointed_layers == 0
        randomize(model)
        runs[plan[0]] = _run(model, packed)
    (out0, grads0, bytes0), (out1, grads1, bytes1) = runs["none"], runs[policy]
    for a, b in zip(out0, out1):
        assert torch.equal(a, b)  # the same ops run forward
    assert sorted(grads0) == sorted(grads1) and len(grads0) > 0
    for name, grad in grads0.items():
        torch.testing.assert_close(grads1[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    print(f"saved bytes: {policy} {bytes1}, none {bytes0}")
    assert bytes1 < 0.95 * bytes0  # tiny layers: the hybrid's torch delta rule saves most of its bytes


def test_layer_recompute_names_a_policy_for_every_layer(qwen3_base):
    with pytest.raises(ValueError, match="layer_recompute=.* must name one of none, mixer, mlp, layer"):
        actor_critic(qwen3_base, LORA, gradient_checkpointing=True, layer_recompute=["mixer"])
    with pytest.raises(ValueError, match="needs gradient_checkpointing=True"):
        actor_critic(qwen3_base, LORA, layer_recompute=["mixer", "mlp"])


def test_auto_left_unresolved_checkpoints_every_layer(qwen3_base):
    """``checkpoint_layers=auto`` reaches the model unresolved only off a card (``run/recompute.py``
    resolves it on one): every layer, as ``None``; without checkpointing, none and no refusal."""
    model = actor_critic(qwen3_base, LORA, gradient_checkpointing=True, checkpoint_layers="auto")
    assert model.layer_recompute == ["layer", "layer"] and model.checkpointed_layers == 2
    model = actor_critic(qwen3_base, LORA, gradient_checkpointing=False, checkpoint_layers="auto")
    assert model.layer_recompute == ["none", "none"] and model.checkpointed_layers == 0


@pytest.mark.parametrize("base_name", ["qwen3_base", "qwen3_5_base"])
@pytest.mark.parametrize("lean", [False, True])
def test_the_checkpointed_count_changes_no_value(base_name, lean, request, randomize):
    """Whatever count ``checkpoint_layers=auto`` takes, the forward and the gradients are the same
    bit for bit (here, on CPU; lean activations too: a kept layer's lean MLP tail runs the ops a
    replayed layer's autograd runs). On CUDA liger's fused product runs in replayed layers and the
    lean tail in kept ones: not checked here."""
    base = request.getfixturevalue(base_name)
    g = torch.Generator().manual_seed(0)
    packed = pack_sequences([torch.randint(0, 128, (n,), generator=g) for n in LENGTHS], PROMPTS)
    runs = []
    for count in (0, 1, 2):
        model = actor_critic(base, LORA, logprob_chunk_tokens=5, gradient_checkpointing=True, checkpoint_layers=count,
                             lean_activations=lean)
        assert model.checkpointed_layers == count
        randomize(model)
        runs.append(_run(model, packed))
    (out0, grads0, _), others = runs[-1], runs[:-1]
    for out, grads, _ in others:
        assert all(torch.equal(a, b) for a, b in zip(out, out0))
        assert sorted(grads) == sorted(grads0) and grads0
        assert all(torch.equal(grads[name], grad) for name, grad in grads0.items())


def _calls(module) -> list[int]:
    """A counter of ``module``'s forward calls (replays included: they call it again)."""
    count = [0]
    module.register_forward_hook(lambda *args: count.__setitem__(0, count[0] + 1))
    return count


@pytest.mark.parametrize("base_name", ["qwen3_base", "qwen3_5_base"])
def test_recompute_tiers_switch_per_micro_batch_and_change_no_value(base_name, request, randomize):
    """A model built at its budget's plan (every layer replayed whole) with tiers for smaller
    micro-batches (``enable_recompute_tiers``) runs each micro-batch under the plan of the
    smallest tier that holds it: what it replays changes (counted at each layer's first
    projection of the mixer and of the MLP), the forward and the gradients do not."""
    from atlas_lightning.models.recompute import mixer_of

    base = request.getfixturevalue(base_name)
    g = torch.Generator().manual_seed(0)
    packed = pack_sequences([torch.randint(0, 128, (n,), generator=g) for n in LENGTHS], PROMPTS)  # 32 tokens
    reference = actor_critic(base, LORA, logprob_chunk_tokens=5, gradient_checkpointing=True)
    randomize(reference)
    out0, grads0, _ = _run(reference, packed)

    model = actor_critic(base, LORA, logprob_chunk_tokens=5, gradient_checkpointing=True)
    randomize(model)
    small, large = ["none", "mixer"], ["mixer", "layer"]
    model.enable_recompute_tiers([(64, large), (16, small)])
    assert model.recompute_tiers == [(16, small), (64, large)] and model.active_recompute == ["layer", "layer"]
    # each part's first projection: a replay stopped early (once its saved tensors are back) runs it
    counters = [(_calls(getattr(mixer_of(layer), "q_proj", None) or mixer_of(layer).in_proj_qkv), _calls(layer.mlp.gate_proj))
                for layer in model.decoder_layers()]
    for tokens, plan in ((32, large), (10, small), (16, small), (500, large)):
        assert model.use_recompute_for(tokens) == plan == model.active_recompute
        for mixer_calls, mlp_calls in counters:
            mixer_calls[0] = mlp_calls[0] = 0
        out, grads, _ = _run(model, packed)
        assert all(torch.equal(a, b) for a, b in zip(out, out0))
        assert sorted(grads) == sorted(grads0)
        for name, grad in grads0.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
        # two passes (actor, critic), each run once more in the backward where the plan replays it
        replays = [(mixer_calls[0] // 2 - 1, mlp_calls[0] // 2 - 1) for mixer_calls, mlp_calls in counters]
        assert replays == [(int(p in ("layer", "mixer")), int(p == "layer")) for p in plan], (tokens, plan, replays)


def test_recompute_tiers_refuse_what_cannot_switch(qwen3_base):
    model = actor_critic(qwen3_base, LORA, gradient_checkpointing=True, layer_recompute=["mlp", "layer"])
    with pytest.raises(ValueError, match="without policy mlp"):
        model.enable_recompute_tiers([(16, ["none", "none"])])
    model = actor_critic(qwen3_base, LORA, gradient_checkpointing=True)
    with pytest.raises(ValueError, match="must name layer, mixer or none"):
        model.enable_recompute_tiers([(16, ["mlp", "none"])])
    with pytest.raises(ValueError, match="must name layer, mixer or none"):
        model.enable_recompute_tiers([(16, ["none"])])
    with pytest.raises(ValueError, match="need gradient_checkpointing=True"):
        actor_critic(qwen3_base, LORA).enable_recompute_tiers([(16, ["none", "none"])])
