"""The decoupled PPO loss (off-policy correction) against a plain-Python reference of AReaL's
objective, and its identity with the vanilla loss when the rollout was on-policy."""

import math

import pytest
import torch

from atlas_lightning.algorithms.ppo import (
    behaviour_importance_weights,
    compute_policy_loss_decoupled,
    compute_policy_loss_vanilla,
)
from atlas_lightning.config import AlgorithmConfig

MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


# ----------------------------------------------------------------------------- reference


def ref_token(behav, prox, new, adv, low, high, c, cap, mode):
    """(weighted loss, weight, above the cap?) of one token, written from the paper's formula:
    three policies, the trust region around the proximal one, the behaviour weight capped."""
    ratio = math.exp(min(max(new - prox, -20.0), 20.0))
    loss = max(-adv * ratio, -adv * min(max(ratio, 1 - low), 1 + high))
    if adv < 0:
        loss = min(loss, -adv * c)
    weight = math.exp(min(max(prox - behav, -20.0), 20.0))
    above = weight > cap
    if above:
        weight = cap if mode == "truncate" else 0.0
    return loss * weight, weight, above


def ref_loss(behav, prox, new, adv, mask, low, high, c, cap, mode, agg):
    table = [[ref_token(b, p, n, a, low, high, c, cap, mode) for b, p, n, a in zip(*rows)]
             for rows in zip(behav, prox, new, adv)]
    rows = [[cell[0] for cell, keep in zip(row, mrow) if keep] for row, mrow in zip(table, mask)]
    if agg == "token-mean":
        value = sum(map(sum, rows)) / sum(map(len, rows))
    elif agg == "token-sum":
        value = sum(map(sum, rows))
    else:
        nonempty = [r for r in rows if r]
        if agg == "seq-mean-token-mean":
            value = sum(sum(r) / (len(r) + 1e-8) for r in nonempty) / len(nonempty)
        else:
            value = sum(map(sum, nonempty)) / len(nonempty)
            if agg == "seq-mean-token-sum-norm":
                value /= len(mask[0])
    kept = [cell for row, mrow in zip(table, mask) for cell, keep in zip(row, mrow) if keep]
    behav_kl = [b - p for rb, rp, mrow in zip(behav, prox, mask) for b, p, keep in zip(rb, rp, mrow) if keep]
    return value, {"actor/behav_imp_weight_mean": sum(k[1] for k in kept) / len(kept),
                   "actor/behav_capped_frac": sum(k[2] for k in kept) / len(kept),
                   "actor/behav_kl": sum(behav_kl) / len(behav_kl)}


def _random(seed, bs=6, length=13, staleness=0.6):
    g = torch.Generator().manual_seed(seed)
    behav = -torch.rand(bs, length, generator=g, dtype=torch.float64) * 3
    prox = behav + torch.randn(bs, length, generator=g, dtype=torch.float64) * staleness
    new = prox + torch.randn(bs, length, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(bs, length, generator=g, dtype=torch.float64)
    mask = (torch.rand(bs, length, generator=g) > 0.25).double()
    mask[3] = 0
    mask[0, 0] = 1
    return behav, prox, new, adv, mask


def _config(cap=2.0, mode="truncate", **clips):
    return AlgorithmConfig(off_policy_loss="decoupled", behav_imp_weight_cap=cap, behav_imp_weight_mode=mode, **clips)


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("agg", MODES)
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_decoupled_loss_matches_reference(agg, mode):
    behav, prox, new, adv, mask = _random(seed=3)
    config = _config(cap=1.5, mode=mode, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    loss, metrics = compute_policy_loss_decoupled(prox, new, adv, mask, behav, agg, config)
    expected, behaviour = ref_loss(behav.tolist(), prox.tolist(), new.tolist(), adv.tolist(), mask.tolist(),
                                   0.2, 0.28, 3.0, 1.5, mode, agg)
    assert loss.item() == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert {k: metrics[k] for k in behaviour} == pytest.approx(behaviour, rel=1e-9, abs=1e-12)
    assert 0 < behaviour["actor/behav_capped_frac"] < 1  # the cap binds on some tokens, not all


def test_on_policy_rollout_gives_the_vanilla_loss_bit_for_bit():
    _, prox, new, adv, mask = _random(seed=5)
    prox, new, adv, mask = (t.float() for t in (prox, new, adv, mask))
    info = {"dp_size": 2, "batch_num_tokens": 123}
    for mode in ("truncate", "mask"):
        config = _config(mode=mode)
        new_a, new_b = new.clone().requires_grad_(), new.clone().requires_grad_()
        vanilla, vanilla_metrics = compute_policy_loss_vanilla(prox, new_a, adv, mask, "token-mean", config,
                                                               global_batch_info=info)
        decoupled, metrics = compute_policy_loss_decoupled(prox, new_b, adv, mask, prox.clone(), "token-mean", config,
                                                           global_batch_info=info)
        assert torch.equal(decoupled, vanilla)
        vanilla.backward()
        decoupled.backward()
        assert torch.equal(new_a.grad, new_b.grad)
        assert {k: metrics[k] for k in vanilla_metrics} == vanilla_metrics
        assert metrics["actor/behav_imp_weight_mean"] == 1.0 and metrics["actor/behav_kl"] == 0.0


def test_weights_truncate_or_mask_above_the_cap_and_carry_no_gradient():
    prox = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    behav = torch.log(torch.tensor([[0.5, 0.25, 0.05, 0.9]]))  # weights 1, 2, 10, 0.555...
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    truncated, metrics = behaviour_importance_weights(prox, behav, mask, cap=5.0)
    assert truncated[0].tolist() == pytest.approx([1.0, 2.0, 5.0, 0.0])
    assert metrics["actor/behav_capped_frac"] == pytest.approx(1 / 3)
    masked, _ = behaviour_importance_weights(prox, behav, mask, cap=5.0, mode="mask")
    assert masked[0].tolist() == pytest.approx([1.0, 2.0, 0.0, 0.0])
    # the gradient of the loss w.r.t. the current log-probs is the vanilla one times w
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0]])
    new = prox.clone().requires_grad_()
    loss, _ = compute_policy_loss_decoupled(prox, new, adv, mask, behav, "token-sum", _config(cap=5.0))
    loss.backward()
    assert new.grad[0].tolist() == pytest.approx([-1.0, 2.0, -5.0, 0.0])


def test_decoupled_loss_refuses_bad_arguments():
    behav, prox, new, adv, mask = _random(seed=1)
    with pytest.raises(ValueError, match="cap=0.5 must be >= 1"):
        compute_policy_loss_decoupled(prox, new, adv, mask, behav, "token-mean", _config(cap=0.5))
    with pytest.raises(ValueError, match="mode='clip' is not one of truncate, mask"):
        compute_policy_loss_decoupled(prox, new, adv, mask, behav, "token-mean", _config(mode="clip"))
    with pytest.raises(ValueError, match="rollout_log_prob has shape"):
        compute_policy_loss_decoupled(prox, new, adv, mask, behav[:, :3], "token-mean", _config())
    with pytest.raises(ValueError, match="config is required"):
        compute_policy_loss_decoupled(prox, new, adv, mask, behav)


def test_default_config_keeps_the_vanilla_loss():
    """The schema's default is no correction: synchronous runs compute what they always did."""
    assert AlgorithmConfig().off_policy_loss == "none"
