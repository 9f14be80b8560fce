"""Policy loss (dual clip), value loss and loss aggregation against plain-Python references.

The policy loss is the step's, ``compute_policy_loss_vanilla``; most cases call it through
``compute_policy_loss`` below, verl's old-style signature and return tuple."""

import math

import pytest
import torch

from atlas_lightning.algorithms.ppo import (
    agg_loss,
    compute_policy_loss_vanilla,
    compute_value_loss,
)
from atlas_lightning.config import AlgorithmConfig
from verl_reference import compute_entropy_loss

MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


# ----------------------------------------------------------------------------- references


def ref_agg(loss, mask, mode, dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None):
    rows = [[x for x, f in zip(lr, mr) if f] for lr, mr in zip(loss, mask)]
    if mode == "token-mean":
        total = batch_num_tokens if batch_num_tokens is not None else sum(len(r) for r in rows)
        return sum(sum(r) for r in rows) / total * dp_size
    if mode == "token-sum":
        return sum(sum(r) for r in rows) * dp_size
    nonempty = [r for r in rows if r]
    count = global_batch_size if global_batch_size is not None else len(nonempty)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / (len(r) + 1e-8) for r in nonempty) / count * dp_size  # verl keeps the 1e-8
    value = sum(sum(r) for r in nonempty) / count * dp_size
    if mode == "seq-mean-token-sum-norm":
        value /= loss_scale_factor if loss_scale_factor is not None else len(mask[0])
    return value


def ref_policy_token(old, new, adv, low, high, c):
    """(loss, ratio-clip bound?, dual-clip bound?, k1 kl) of one token."""
    log_ratio = min(max(new - old, -20.0), 20.0)
    ratio = math.exp(log_ratio)
    plain = -adv * ratio
    clipped = -adv * min(max(ratio, 1 - low), 1 + high)
    loss = max(plain, clipped)
    lower = False
    if adv < 0 and loss > -adv * c:
        loss, lower = -adv * c, True
    return loss, clipped > plain, lower, -log_ratio


def ref_policy(old, new, adv, mask, low, high, c, mode):
    table = [[ref_policy_token(o, n, a, low, high, c) for o, n, a in zip(ro, rn, ra)] for ro, rn, ra in zip(old, new, adv)]
    kept = [cell for row, mrow in zip(table, mask) for cell, f in zip(row, mrow) if f]
    n = len(kept)
    loss = ref_agg([[cell[0] for cell in row] for row in table], mask, mode)
    return loss, sum(k[1] for k in kept) / n, sum(k[3] for k in kept) / n, sum(k[2] for k in kept) / n


def compute_policy_loss(old_log_prob, log_prob, advantages, response_mask, cliprange=None, cliprange_low=None,
                        cliprange_high=None, clip_ratio_c=3.0, loss_agg_mode="token-mean"):
    """``compute_policy_loss_vanilla`` called as verl's old-style ``compute_policy_loss``:
    ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``, the last three as float64 0-dim tensors."""
    config = {"clip_ratio": cliprange, "clip_ratio_low": cliprange_low, "clip_ratio_high": cliprange_high,
              "clip_ratio_c": clip_ratio_c}
    pg_loss, metrics = compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config)
    stats = (metrics[f"actor/{name}"] for name in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"))
    return (pg_loss, *(torch.tensor(value, dtype=torch.float64) for value in stats))


def _random(seed, bs=5, length=11):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(bs, length, generator=g, dtype=torch.float64) * 3
    new = old + torch.randn(bs, length, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(bs, length, generator=g, dtype=torch.float64)
    mask = (torch.rand(bs, length, generator=g) > 0.25).double()
    mask[2] = 0  # an all-masked row
    mask[0, 0] = 1
    return old, new, adv, mask


# ----------------------------------------------------------------------------- policy loss


def test_each_clip_regime_on_hand_made_tokens():
    # (advantage, ratio): ratio clip high, below the low bound but unclipped (A>0), ratio clip low,
    # dual clip, negative A within the dual bound, and a masked extreme token.
    cases = [(1.0, 1.5), (1.0, 0.5), (-1.0, 0.5), (-1.0, 5.0), (-1.0, 2.0), (-5.0, 100.0)]
    adv = torch.tensor([[a for a, _ in cases]], dtype=torch.float64)
    new = torch.tensor([[math.log(r) for _, r in cases]], dtype=torch.float64)
    old = torch.zeros_like(new)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=torch.float64)
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(old, new, adv, mask, cliprange=0.2, clip_ratio_c=3.0)
    # Per-token losses: -1.2 (clipped at 1.2), -0.5, 0.8 (clipped at 0.8), 3.0 (dual), 2.0.
    assert pg_loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 3.0 + 2.0) / 5)
    assert clipfrac.item() == pytest.approx(2 / 5, rel=1e-7)  # tokens 0 and 2; at token 3 the unclipped term is larger
    assert clipfrac_lower.item() == pytest.approx(1 / 5, rel=1e-7)
    assert ppo_kl.item() == pytest.approx(-sum(math.log(r) for _, r in cases[:5]) / 5, rel=1e-7)


def test_gradient_vanishes_on_clipped_tokens():
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    ratios = [1.5, 1.1, 0.5, 5.0, 2.0]
    new = torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 5, dtype=torch.float64)
    pg_loss, *_ = compute_policy_loss(old, new, adv, torch.ones(1, 5), cliprange=0.2, clip_ratio_c=3.0)
    pg_loss.backward()
    # d(-A r)/d log r = -A r on unclipped tokens, 0 where a clip binds; token-mean over 5.
    expected = [0.0, -1.1 / 5, 0.0, 0.0, 2.0 / 5]
    assert new.grad[0].tolist() == pytest.approx(expected)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clips", [(0.2, 0.2, 3.0), (0.1, 0.28, 1.5)])
def test_policy_loss_matches_reference(mode, clips):
    low, high, c = clips
    old, new, adv, mask = _random(seed=7)
    got = compute_policy_loss(old, new, adv, mask, cliprange_low=low, cliprange_high=high, clip_ratio_c=c, loss_agg_mode=mode)
    expected = ref_policy(old.tolist(), new.tolist(), adv.tolist(), mask.tolist(), low, high, c, mode)
    assert [x.item() for x in got] == pytest.approx(list(expected), rel=1e-9, abs=1e-12)


def test_extreme_log_ratio_is_clamped_not_inf():
    old = torch.zeros(1, 2)
    new = torch.tensor([[60.0, -60.0]])
    pg_loss, _, ppo_kl, _ = compute_policy_loss(old, new, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), cliprange=0.2)
    assert math.isfinite(pg_loss.item()) and ppo_kl.item() == pytest.approx(0.0)


def test_policy_loss_rejects_bad_arguments():
    old, new, adv, mask = _random(seed=1)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss(old, new, adv, mask, cliprange=0.2, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="clip_ratio, or both clip_ratio_low and clip_ratio_high"):
        compute_policy_loss(old, new, adv, mask)
    with pytest.raises(ValueError, match="advantages has shape"):
        compute_policy_loss(old, new, adv[:, :3], mask, cliprange=0.2)


def test_vanilla_adapter_takes_our_config_and_global_batch_info():
    old, new, adv, mask = _random(seed=11)
    config = AlgorithmConfig(clip_ratio_low=0.15, clip_ratio_high=0.3, clip_ratio_c=2.0)
    loss, metrics = compute_policy_loss_vanilla(old, new, adv, mask, "token-mean", config)
    expected = ref_policy(old.tolist(), new.tolist(), adv.tolist(), mask.tolist(), 0.15, 0.3, 2.0, "token-mean")
    assert loss.item() == pytest.approx(expected[0], rel=1e-9)
    assert metrics == pytest.approx({"actor/pg_clipfrac": expected[1], "actor/ppo_kl": expected[2], "actor/pg_clipfrac_lower": expected[3]}, rel=1e-7)
    # Importance weights scale the per-token losses; global counts normalise over all ranks.
    weights = torch.full_like(adv, 0.5)
    info = {"dp_size": 4, "batch_num_tokens": 1000}
    scaled, _ = compute_policy_loss_vanilla(old, new, adv, mask, "token-mean", config, weights, global_batch_info=info)
    n_local = mask.sum().item()
    assert scaled.item() == pytest.approx(expected[0] * 0.5 * n_local / 1000 * 4, rel=1e-9)
    # verl-style config: clip_ratio_low/high fall back to clip_ratio (clip_ratio_c to 3.0).
    verl_style = {"clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": None}
    loss_verl, _ = compute_policy_loss_vanilla(old, new, adv, mask, "token-mean", verl_style)
    fallback = ref_policy(old.tolist(), new.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.2, 3.0, "token-mean")
    assert loss_verl.item() == pytest.approx(fallback[0], rel=1e-9)
    with pytest.raises(ValueError, match="config is required"):
        compute_policy_loss_vanilla(old, new, adv, mask)


# ----------------------------------------------------------------------------- value loss


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_value_loss_matches_reference(mode):
    g = torch.Generator().manual_seed(2)
    vpreds, returns, values = (torch.randn(4, 9, generator=g, dtype=torch.float64) for _ in range(3))
    mask = (torch.rand(4, 9, generator=g) > 0.3).double()
    vf_loss, vf_clipfrac = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.5, loss_agg_mode=mode)
    losses, flags = [], []
    for rv, rr, rold in zip(vpreds.tolist(), returns.tolist(), values.tolist()):
        row_l, row_f = [], []
        for v, r, o in zip(rv, rr, rold):
            v_clipped = min(max(v, o - 0.5), o + 0.5)
            row_l.append(max((v - r) ** 2, (v_clipped - r) ** 2))
            row_f.append((v_clipped - r) ** 2 > (v - r) ** 2)
        losses.append(row_l)
        flags.append(row_f)
    m = mask.tolist()
    assert vf_loss.item() == pytest.approx(0.5 * ref_agg(losses, m, mode), rel=1e-10)
    kept = [f for fr, mr in zip(flags, m) for f, k in zip(fr, mr) if k]
    assert vf_clipfrac.item() == pytest.approx(sum(kept) / len(kept), rel=1e-7)


def test_value_loss_without_clipping_is_half_the_mse():
    vpreds = torch.tensor([[1.0, 2.0, 3.0]])
    returns = torch.tensor([[0.0, 0.0, 0.0]])
    vf_loss, vf_clipfrac = compute_value_loss(vpreds, returns, vpreds.clone(), torch.ones(1, 3), cliprange_value=100.0)
    assert vf_loss.item() == pytest.approx(0.5 * (1 + 4 + 9) / 3)
    assert vf_clipfrac.item() == 0.0


def test_value_loss_rejects_bad_arguments():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="returns has shape"):
        compute_value_loss(x, x[:1], x, x, 0.5)
    with pytest.raises(ValueError, match="cliprange_value"):
        compute_value_loss(x, x, x, x, -0.1)


# ----------------------------------------------------------------------------- aggregation


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_matches_reference(mode):
    g = torch.Generator().manual_seed(4)
    loss = torch.randn(5, 8, generator=g, dtype=torch.float64)
    mask = (torch.rand(5, 8, generator=g) > 0.4).double()
    mask[1] = 0  # excluded from the seq-mean modes' sequence count
    mask[0, 0] = 1
    m = mask.tolist()
    assert agg_loss(loss, mask, mode).item() == pytest.approx(ref_agg(loss.tolist(), m, mode), rel=1e-7)
    extra = {"dp_size": 3, "batch_num_tokens": 40, "global_batch_size": 12, "loss_scale_factor": 16}
    assert agg_loss(loss, mask, mode, **extra).item() == pytest.approx(ref_agg(loss.tolist(), m, mode, **extra), rel=1e-7)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_agg_loss_is_invariant_to_the_data_parallel_split(mode):
    """Sum over micro-batches on each rank, averaged over ranks (FSDP's gradient reduction) = whole batch."""
    g = torch.Generator().manual_seed(9)
    loss = torch.randn(12, 10, generator=g, dtype=torch.float64)
    mask = (torch.rand(12, 10, generator=g) > 0.3).double()
    mask[5] = 0
    whole = agg_loss(loss, mask, mode).item()
    dp_size = 3
    info = {
        "dp_size": dp_size,
        "batch_num_tokens": int(mask.sum().item()),
        "global_batch_size": int((mask.sum(-1) > 0).sum().item()),
    }
    splits = [[[0, 1], [2, 3]], [[4, 5, 6], [7]], [[8], [9, 10, 11]]]  # ranks x micro-batches
    per_rank = [sum(agg_loss(loss[mb], mask[mb], mode, **info).item() for mb in rank) for rank in splits]
    assert sum(per_rank) / dp_size == pytest.approx(whole, rel=1e-10)


def test_agg_loss_rejects_bad_input():
    x = torch.ones(2, 3)
    with pytest.raises(ValueError, match="not one of"):
        agg_loss(x, x, "token-average")
    with pytest.raises(ValueError, match="batch_num_tokens"):
        agg_loss(x, x, "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="global_batch_size"):
        agg_loss(x, x, "seq-mean-token-mean", dp_size=2)
    with pytest.raises(ValueError, match="loss_mask shape"):
        agg_loss(x, x[:, :2], "token-mean")


def test_entropy_loss_is_the_masked_mean_entropy():
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3.0)]], [[9.0, 9.0], [1.0, 1.0]]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    h_quarter = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    expected = (math.log(2) + h_quarter + math.log(2)) / 3
    assert compute_entropy_loss(logits, mask).item() == pytest.approx(expected, rel=1e-7)
