"""Masked reductions with verl 0.9's numerics.

The twins of ``verl/utils/torch_functional.py`` (``masked_sum``, ``masked_mean``,
``masked_var``, ``masked_whiten``, ``clip_by_value``): same argument names, defaults and
arithmetic order, so results agree bit for bit on the same tensors
(``tests/algorithms/verl_parity.py`` checks that). Log-probs and entropy are computed from
hidden states a chunk at a time (``models/logprobs.py``); verl's full-logits helpers are the
tests' reference (``tests/algorithms/verl_reference.py``).

Masks may be bool, integer or float tensors of the values' shape; a position counts when
its mask is non-zero. Every function here is pure torch and differentiable where the maths
is. Who calls it: ``ppo.py`` (losses, GAE whitening), ``kl.py``, the PPO step's metrics.
"""

from __future__ import annotations

import torch

__all__ = [
    "clip_by_value",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is non-zero, over ``axis`` (None: everything).

    Values outside the mask are replaced by 0 before the product, so a NaN or inf in a
    masked-out position (padding, a tool response) never reaches the sum.
    """
    kept = torch.where(mask.bool(), values, 0.0)
    return (kept * mask).sum(axis=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Mean of ``values`` over the positions ``mask`` selects, over ``axis`` (None: all).

    An empty selection gives 0 (the 1e-8 in the denominator, as verl), not NaN.
    """
    return masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the selected values over the whole tensor (a 0-dim tensor).

    ``unbiased`` applies Bessel's correction n/(n-1) with n = ``mask.sum()``; it needs n >= 2
    and raises ``ValueError`` otherwise (verl's behaviour: whitening a batch with a single
    response token is an error, not a silent inf).
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count == 0:
            raise ValueError("masked_var: the mask selects no element (at least two are needed)")
        if count == 1:
            raise ValueError("masked_var: the mask selects one element; the unbiased variance needs at least two")
        # Kept as a tensor ratio (not a Python float) so the rounding matches verl's.
        variance = variance * (count / (count - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """``(values - mean) / sqrt(var + 1e-8)`` with mean and unbiased variance over ``mask``.

    Every position is transformed (masked ones too: callers mask them later). With
    ``shift_mean=False`` the mean is added back after scaling.
    """
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def clip_by_value(x: torch.Tensor, tensor_min: torch.Tensor, tensor_max: torch.Tensor) -> torch.Tensor:
    """``x`` clamped element-wise into ``[tensor_min, tensor_max]`` (tensor bounds broadcast)."""
    return torch.max(torch.min(x, tensor_max), tensor_min)
