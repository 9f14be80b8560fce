"""GAE that steps over masked tool tokens, against a closed-form plain-Python reference."""

import math

import pytest
import torch

from atlas_lightning.algorithms.ppo import compute_gae_advantage_return


def ref_raw_advantages(rewards, values, mask, gamma, lam):
    """Closed form per row: with u_0 < u_1 < ... the unmasked positions,
    delta_j = r[u_j] + gamma * V[u_{j+1}] - V[u_j] (V past the last one is 0) and
    A[u_j] = sum_l (gamma * lam)^l delta_{j+l}. A masked position takes the advantage of the
    next unmasked position to its right (0 if none)."""
    out = []
    for r, v, m in zip(rewards, values, mask):
        kept = [t for t, flag in enumerate(m) if flag]
        deltas = []
        for j, t in enumerate(kept):
            next_value = v[kept[j + 1]] if j + 1 < len(kept) else 0.0
            deltas.append(r[t] + gamma * next_value - v[t])
        at_kept = {t: sum((gamma * lam) ** k * deltas[j + k] for k in range(len(kept) - j)) for j, t in enumerate(kept)}
        row = []
        for t in range(len(m)):
            following = [u for u in kept if u >= t]
            row.append(at_kept[following[0]] if following else 0.0)
        out.append(row)
    return out


def ref_whiten(matrix, mask):
    chosen = [x for row, mrow in zip(matrix, mask) for x, f in zip(row, mrow) if f]
    mean = sum(chosen) / len(chosen)
    var = sum((x - mean) ** 2 for x in chosen) / (len(chosen) - 1)
    return [[(x - mean) / math.sqrt(var + 1e-8) for x in row] for row in matrix]


def _case(seed=0, bs=5, length=12):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(bs, length, generator=g, dtype=torch.float64)
    values = torch.randn(bs, length, generator=g, dtype=torch.float64)
    mask = torch.ones(bs, length)
    mask[0, 4:7] = 0  # tool response in the middle
    mask[1, 2:4] = 0
    mask[1, 8:] = 0  # and right padding
    mask[2, 10:] = 0
    mask[3, 0:2] = 0  # a masked start
    return rewards, values, mask.double()


def _flat(x):
    return [v for row in x for v in row]


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8), (0.99, 0.0), (0.5, 1.0)])
def test_gae_matches_closed_form(gamma, lam):
    rewards, values, mask = _case()
    advantages, returns = compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    raw = ref_raw_advantages(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    expected_returns = [[a + v for a, v in zip(ra, rv)] for ra, rv in zip(raw, values.tolist())]
    assert _flat(returns.tolist()) == pytest.approx(_flat(expected_returns), rel=1e-10, abs=1e-12)
    assert _flat(advantages.tolist()) == pytest.approx(_flat(ref_whiten(raw, mask.tolist())), rel=1e-7, abs=1e-9)


def test_terminal_reward_flows_over_a_tool_span_unchanged():
    # gamma = lam = 1: return at every generated token = sum of later rewards on generated tokens.
    rewards = torch.zeros(2, 8, dtype=torch.float64)
    rewards[0, 6] = 1.0  # on the last generated token
    rewards[0, 3] = 5.0  # on a tool token: ignored by design (not a policy action)
    rewards[1, 2] = -0.5
    rewards[1, 7] = 2.0
    values = torch.linspace(-1, 1, 16, dtype=torch.float64).reshape(2, 8)
    mask = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    _, returns = compute_gae_advantage_return(rewards, values, mask, 1.0, 1.0)
    assert returns[0, [0, 1, 2, 5, 6]].tolist() == pytest.approx([1.0] * 5)
    assert returns[1].tolist() == pytest.approx([1.5, 1.5, 1.5, 2.0, 2.0, 2.0, 2.0, 2.0])
    # A masked token carries the advantage of the next generated token; past the end, 0.
    raw = returns - values
    assert raw[0, 3].item() == pytest.approx(raw[0, 5].item())
    assert raw[0, 7].item() == 0.0


def test_all_masked_row_is_left_out_of_whitening():
    rewards, values, mask = _case(seed=3)
    mask[4] = 0
    advantages, returns = compute_gae_advantage_return(rewards, values, mask, 0.95, 0.9)
    raw = ref_raw_advantages(rewards.tolist(), values.tolist(), mask.tolist(), 0.95, 0.9)
    assert raw[4] == [0.0] * 12
    assert returns[4].tolist() == pytest.approx(values[4].tolist())  # nothing to add
    assert _flat(advantages.tolist()) == pytest.approx(_flat(ref_whiten(raw, mask.tolist())), rel=1e-7, abs=1e-9)
    chosen = advantages[mask.bool()]
    assert chosen.mean().item() == pytest.approx(0.0, abs=1e-7)
    assert chosen.std().item() == pytest.approx(1.0, rel=1e-6)


def test_bool_int_and_float_masks_give_the_same_result():
    rewards, values, mask = _case(seed=5)
    ref_adv, ref_ret = compute_gae_advantage_return(rewards, values, mask, 0.9, 0.7)
    for other in (mask.bool(), mask.long()):
        adv, ret = compute_gae_advantage_return(rewards, values, other, 0.9, 0.7)
        assert torch.equal(ret, ref_ret)
        assert torch.allclose(adv, ref_adv, rtol=1e-7, atol=1e-9)


def test_no_gradient_flows():
    rewards, values, mask = _case()
    values.requires_grad_(True)
    advantages, returns = compute_gae_advantage_return(rewards, values, mask, 1.0, 1.0)
    assert not advantages.requires_grad and not returns.requires_grad


def test_bad_input_is_named():
    rewards, values, mask = _case()
    with pytest.raises(ValueError, match="values has shape"):
        compute_gae_advantage_return(rewards, values[:, :-1], mask, 1.0, 1.0)
    with pytest.raises(ValueError, match="response_mask has shape"):
        compute_gae_advantage_return(rewards, values, mask[:2], 1.0, 1.0)
    with pytest.raises(ValueError, match="bs, response_length"):
        compute_gae_advantage_return(rewards[0], values[0], mask[0], 1.0, 1.0)
    lonely = torch.zeros_like(mask)
    lonely[0, 0] = 1
    with pytest.raises(ValueError, match="selects one element"):
        compute_gae_advantage_return(rewards, values, lonely, 1.0, 1.0)


def test_whiten_off_gives_the_raw_advantages_and_the_same_returns():
    """``whiten=False`` leaves the whitening to the caller (the PPO step whitens over every rank's
    tokens at once): the advantages are GAE's own, the returns are the same as verl's default."""
    rewards, values, mask = _case(seed=7)
    whitened, returns = compute_gae_advantage_return(rewards, values, mask, 0.9, 0.8)
    raw, raw_returns = compute_gae_advantage_return(rewards, values, mask, 0.9, 0.8, whiten=False)
    assert torch.equal(raw_returns, returns)
    expected = ref_raw_advantages(rewards.tolist(), values.tolist(), mask.tolist(), 0.9, 0.8)
    assert _flat(raw.tolist()) == pytest.approx(_flat(expected), rel=1e-10, abs=1e-12)
    assert torch.allclose(whitened, ref_whiten_tensor(raw, mask))
    lonely = torch.zeros_like(mask)  # one token here: nothing to whiten locally, and no error
    lonely[0, 0] = 1
    compute_gae_advantage_return(rewards, values, lonely, 1.0, 1.0, whiten=False)


def ref_whiten_tensor(x, mask):
    return torch.tensor(ref_whiten(x.tolist(), mask.tolist()), dtype=x.dtype)
