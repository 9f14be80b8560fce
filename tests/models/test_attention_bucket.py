"""``sdpa_varlen`` with a length bucket (``models/attention.py``): padding each sequence's q/k/v
at the end to a multiple of the bucket leaves every real token's output and gradients as they
are (causality), so ``model.attention_length_bucket`` changes which kernels' graphs are reused,
never the results."""

from __future__ import annotations

import torch

from atlas_lightning.models import attention


class _Module(torch.nn.Module):
    pass


def _run(bucket: int, q, k, v, lengths):
    module = _Module()
    attention.set_length_bucket([module], bucket)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, _ = attention.sdpa_varlen_attention_forward(module, *leaves, None, scaling=0.25,
                                                     **{attention.SEQ_LENS_KWARG: lengths})
    grad = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    return [out, *torch.autograd.grad(out, leaves, grad)]


def test_bucketed_lengths_give_the_same_outputs_and_gradients():
    g = torch.Generator().manual_seed(0)
    lengths = (5, 17, 1, 33)
    q = torch.randn(1, 4, sum(lengths), 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, sum(lengths), 8, generator=g, dtype=torch.float64) for _ in range(2))
    exact = _run(0, q, k, v, lengths)
    for bucket in (4, 16, 64):
        for a, b in zip(_run(bucket, q, k, v, lengths), exact):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_bucket_must_not_be_negative():
    import pytest

    with pytest.raises(ValueError, match="must be 0"):
        attention.set_length_bucket([_Module()], -1)
