"""KL estimators, the straight-through '+' variants, controllers and the in-reward penalty (driven
also by verl's adaptive controller, ``verl_reference.py``)."""

import math

import pytest
import torch

from atlas_lightning.algorithms.kl import FixedKLController, apply_kl_penalty, kl_penalty
from verl_reference import AdaptiveKLController

ESTIMATORS = {
    "kl": lambda d: d,
    "k1": lambda d: d,
    "abs": abs,
    "mse": lambda d: 0.5 * d * d,
    "k2": lambda d: 0.5 * d * d,
    # k3 with d = logprob - ref: exp(-d) + d - 1, guarded by verl's clamps.
    "low_var_kl": lambda d: min(max(math.exp(min(max(-d, -20), 20)) - min(max(-d, -20), 20) - 1, -10), 10),
    "k3": lambda d: min(max(math.exp(min(max(-d, -20), 20)) - min(max(-d, -20), 20) - 1, -10), 10),
}


@pytest.fixture
def logprobs():
    g = torch.Generator().manual_seed(0)
    logprob = -torch.rand(3, 7, generator=g, dtype=torch.float64) * 4
    ref = logprob + torch.randn(3, 7, generator=g, dtype=torch.float64)
    ref[0, 0] = logprob[0, 0] + 30.0  # far beyond the exp clamp
    ref[0, 1] = logprob[0, 1] - 30.0
    return logprob, ref


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_estimators_match_their_formulas(logprobs, name):
    logprob, ref = logprobs
    got = kl_penalty(logprob, ref, name)
    expected = [ESTIMATORS[name](a - b) for a, b in zip(logprob.flatten().tolist(), ref.flatten().tolist())]
    assert got.flatten().tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_low_var_kl_is_clamped_to_ten(logprobs):
    logprob, ref = logprobs
    got = kl_penalty(logprob, ref, "low_var_kl")
    assert got[0, 0].item() == 10.0 and got[0, 1].item() == 10.0
    assert (got >= 0).all()  # exp(x) - x - 1 >= 0


@pytest.mark.parametrize("name", ["k1+", "k3+", "low_var_kl+", "abs+"])
def test_plus_variants_keep_the_value_and_take_k2_gradient(logprobs, name):
    logprob, ref = logprobs
    x = logprob.clone().requires_grad_(True)
    value = kl_penalty(x, ref, name)
    value.sum().backward()
    assert torch.equal(value.detach(), kl_penalty(logprob, ref, name[:-1]))
    assert torch.allclose(x.grad, logprob - ref, rtol=0, atol=1e-12)  # d/dx of (x - ref)^2 / 2


def test_unknown_estimator_and_shape_mismatch_are_named(logprobs):
    logprob, ref = logprobs
    with pytest.raises(NotImplementedError, match="'k4'"):
        kl_penalty(logprob, ref, "k4")
    with pytest.raises(ValueError, match="ref_logprob shape"):
        kl_penalty(logprob, ref[:, :3], "kl")


def test_apply_kl_penalty_with_a_fixed_coefficient(logprobs):
    logprob, ref = logprobs
    scores = torch.zeros_like(logprob)
    scores[:, -1] = torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64)
    mask = torch.ones_like(logprob)
    mask[1, 4:] = 0
    rewards, metrics = apply_kl_penalty(scores, logprob, ref, mask, 0.1, kl_penalty="kl")
    per_row = []
    for b in range(3):
        kl = [(logprob[b, t] - ref[b, t]).item() * mask[b, t].item() for t in range(7)]
        for t in range(7):
            assert rewards[b, t].item() == pytest.approx(scores[b, t].item() - 0.1 * kl[t], rel=1e-12, abs=1e-12)
        per_row.append(sum(kl) / sum(mask[b].tolist()))
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(sum(per_row) / 3, rel=1e-7)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1


def test_controllers_update_as_documented(logprobs):
    fixed = FixedKLController(0.2)
    fixed.update(current_kl=5.0, n_steps=100)
    assert fixed.value == 0.2
    adaptive = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.02, horizon=1000)
    adaptive.update(current_kl=0.03, n_steps=10)  # error 0.5, clipped to 0.2
    assert adaptive.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 1000))
    adaptive.update(current_kl=0.019, n_steps=10)  # error -0.05
    assert adaptive.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 1000) * (1 - 0.05 * 10 / 1000))
    logprob, ref = logprobs
    controller = AdaptiveKLController(0.1, 0.02, 1000)
    _, metrics = apply_kl_penalty(torch.zeros_like(logprob), logprob, ref, torch.ones_like(logprob), controller, "abs")
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1  # the coefficient used, before the update
    assert controller.value == pytest.approx(0.1 * (1 + 0.2 * 3 / 1000))  # mean |d| > target; n_steps = batch size
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, 0.02, 0)
