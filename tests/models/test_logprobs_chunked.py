"""Chunked log-probs/entropy: equal to the unchunked computation (values and gradients), and
memory that does not grow with tokens x vocabulary."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from atlas_lightning.models.logprobs import token_logprobs_and_entropy


def _reference(hidden, weight, targets, temperature):
    """Independent: full logits, torch's log_softmax and Categorical entropy."""
    logits = (hidden @ weight.T).float() / temperature
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]
    entropy = torch.distributions.Categorical(logits=logits).entropy()
    return log_probs, entropy


def _inputs(n=23, hidden=16, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g, requires_grad=True)
    w = (torch.randn(vocab, hidden, generator=g) * 0.5).requires_grad_(True)
    t = torch.randint(0, vocab, (n,), generator=g)
    return h, w, t


@pytest.mark.parametrize("chunk", [1, 7, 23, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_unchunked(chunk, temperature):
    h, w, t = _inputs()
    lp, ent = token_logprobs_and_entropy(h, w, t, chunk_tokens=chunk, temperature=temperature)
    assert lp.dtype == torch.float32 and lp.shape == (23,) and ent.shape == (23,)
    # an upstream gradient that weighs tokens differently, through both outputs
    upstream_lp, upstream_ent = torch.linspace(-1, 2, 23), torch.linspace(0.5, -0.5, 23)
    grads = torch.autograd.grad((lp * upstream_lp).sum() + (ent * upstream_ent).sum(), (h, w))

    h_ref, w_ref = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    lp_ref, ent_ref = _reference(h_ref, w_ref, t, temperature)
    ref_grads = torch.autograd.grad((lp_ref * upstream_lp).sum() + (ent_ref * upstream_ent).sum(), (h_ref, w_ref))

    torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-5, atol=1e-5)
    for got, expected in zip(grads, ref_grads):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use", ["log_probs", "entropy"])
def test_gradient_of_one_output_alone_and_of_a_bias(use):
    h, w, t = _inputs()
    b = torch.linspace(-1, 1, w.shape[0]).requires_grad_(True)
    lp, ent = token_logprobs_and_entropy(h, w, t, chunk_tokens=6, temperature=1.3, bias=b)
    out = lp if use == "log_probs" else ent
    grads = torch.autograd.grad((out * torch.linspace(1, 2, 23)).sum(), (h, w, b))
    h_ref, w_ref, b_ref = (x.detach().clone().requires_grad_(True) for x in (h, w, b))
    logits = (h_ref @ w_ref.T + b_ref) / 1.3
    ref = (torch.log_softmax(logits, -1).gather(-1, t[:, None])[:, 0] if use == "log_probs"
           else torch.distributions.Categorical(logits=logits).entropy())
    ref_grads = torch.autograd.grad((ref * torch.linspace(1, 2, 23)).sum(), (h_ref, w_ref, b_ref))
    for got, expected in zip(grads, ref_grads):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_bf16_gradients_follow_autograd_through_a_bf16_head():
    h, w, t = _inputs()
    h16, w16 = h.detach().bfloat16().requires_grad_(True), w.detach().bfloat16()
    lp, ent = token_logprobs_and_entropy(h16, w16, t, chunk_tokens=5)
    (grad,) = torch.autograd.grad(lp.sum() + ent.sum(), h16)
    h_ref = h16.detach().clone().requires_grad_(True)
    lp_ref, ent_ref = _reference(h_ref, w16, t, 1.0)
    (grad_ref,) = torch.autograd.grad(lp_ref.sum() + ent_ref.sum(), h_ref)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad.float(), grad_ref.float(), rtol=2e-2, atol=2e-2)


def _large_logits(n=23, hidden=64, vocab=200, seed=1):
    """bf16 hidden states and head whose logits reach 20-40, as a trained model's top tokens do."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * (8.0 / hidden ** 0.5)
    return h.bfloat16(), w.bfloat16(), torch.randint(0, vocab, (n,), generator=g)


def test_a_float32_head_never_rounds_the_logits_and_the_default_rounds_them_as_verl():
    """``float32_head``: the log-probs of the exact product of the bf16 operands (float64
    reference), where the default rounds each logit to bf16 first (verl's numerics), which at
    logits of 20-40 moves a log-prob by hundredths."""
    h, w, t = _large_logits()
    exact = torch.log_softmax(h.double() @ w.double().T, -1).gather(-1, t[:, None])[:, 0]
    rounded = torch.log_softmax((h.double() @ w.double().T).bfloat16().double(), -1).gather(-1, t[:, None])[:, 0]
    assert (h.double() @ w.double().T).abs().max() > 20
    with torch.no_grad():
        fp32_head, _ = token_logprobs_and_entropy(h, w, t, chunk_tokens=5, float32_head=True)
        default, _ = token_logprobs_and_entropy(h, w, t, chunk_tokens=5)
    assert (fp32_head.double() - exact).abs().max() < 1e-4
    assert (default.double() - exact).abs().mean() > 1e-2
    torch.testing.assert_close(default.double(), rounded, rtol=0, atol=1e-4)


def test_a_float32_heads_gradients_follow_autograd_through_the_exact_product():
    h, w, t = _large_logits()
    h16 = h.clone().requires_grad_(True)
    lp, ent = token_logprobs_and_entropy(h16, w, t, chunk_tokens=4, float32_head=True)
    (grad,) = torch.autograd.grad(lp.sum() + 0.5 * ent.sum(), h16)
    h_ref = h.float().requires_grad_(True)
    lp_ref, ent_ref = _reference(h_ref, w.float(), t, 1.0)
    (grad_ref,) = torch.autograd.grad(lp_ref.sum() + 0.5 * ent_ref.sum(), h_ref)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(lp.detach(), lp_ref.detach(), rtol=0, atol=1e-4)
    torch.testing.assert_close(grad.float(), grad_ref, rtol=2e-2, atol=2e-2)


def test_temperature_changes_the_distribution_like_dividing_logits():
    h, w, t = _inputs()
    with torch.no_grad():
        cold, _ = token_logprobs_and_entropy(h, w, t, chunk_tokens=5, temperature=0.5)
        manual, _ = token_logprobs_and_entropy(h * 2.0, w, t, chunk_tokens=5)  # logits / 0.5 == (2h) @ W^T
    torch.testing.assert_close(cold, manual, rtol=1e-5, atol=1e-5)


def test_entropy_can_be_skipped_and_bf16_is_upcast():
    h, w, t = _inputs()
    lp, ent = token_logprobs_and_entropy(h.bfloat16(), w.bfloat16(), t, chunk_tokens=4, compute_entropy=False)
    assert ent is None and lp.dtype == torch.float32
    expected, _ = _reference(h.detach().bfloat16(), w.detach().bfloat16(), t, 1.0)
    torch.testing.assert_close(lp.detach(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"chunk_tokens": 0}, "chunk_tokens=0"),
        ({"chunk_tokens": 4, "temperature": 0.0}, "temperature=0.0"),
    ],
)
def test_bad_arguments(kwargs, message):
    h, w, t = _inputs()
    with pytest.raises(ValueError, match=message):
        token_logprobs_and_entropy(h, w, t, **kwargs)


def test_bad_shapes_and_targets():
    h, w, t = _inputs()
    with pytest.raises(ValueError, match="hidden must be"):
        token_logprobs_and_entropy(h, w, t[:-1], chunk_tokens=4)
    with pytest.raises(ValueError, match="does not match hidden size"):
        token_logprobs_and_entropy(h, w[:, :-1], t, chunk_tokens=4)
    with pytest.raises(ValueError, match="outside the vocabulary 0..49"):
        token_logprobs_and_entropy(h, w, t.clone().fill_(50), chunk_tokens=4)


# ---------------------------------------------------------------------------- memory


class PeakLiveBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages created inside the block (forward and backward),
    and the largest single storage: every op's outputs are tracked by weak reference."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                ref = StorageWeakRef(storage)
                self.live[ref.cdata] = (ref, storage.nbytes())
                self.largest = max(self.largest, storage.nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _measure(tokens, vocab, chunk, hidden=32):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=g)
    t = torch.randint(0, vocab, (tokens,), generator=g)
    with PeakLiveBytes() as meter:
        if chunk is None:
            lp, ent = _reference(h, w, t, 1.0)
        else:
            lp, ent = token_logprobs_and_entropy(h, w, t, chunk_tokens=chunk)
        (lp.sum() + ent.sum()).backward()
    return meter.peak, meter.largest


def test_peak_memory_does_not_scale_with_tokens_times_vocab():
    vocab, chunk = 2048, 64
    chunk_logits = chunk * vocab * 4
    small, large = _measure(256, vocab, chunk), _measure(1024, vocab, chunk)
    full_small, full_large = _measure(256, vocab, None), _measure(1024, vocab, None)
    # the largest tensor ever alive is one chunk's fp32 logits, whatever the token count
    assert small[1] == large[1] == chunk_logits
    # unchunked peak grows with T x V (4x tokens -> ~4x memory); chunked stays a few chunks
    assert full_large[0] > 3.5 * full_small[0]
    assert large[0] < 1.3 * small[0]
    assert large[0] < 5 * chunk_logits < full_large[0] / 5
