"""``bench/choose.py``: the least recomputation that fits a memory cap, over micro-batch budgets."""

from __future__ import annotations

from atlas_lightning.bench.choose import SAFETY, choose, recompute_flops

FLOPS = recompute_flops({"mixer": [(64, 96), (64, 16), (64, 16), (64, 64)], "mlp": [(64, 128), (64, 128), (128, 64)]},
                        attention_per_token=1000.0)
COMMON = dict(layers=6, static_gib=10.0, sweep_layers=2, sweep_tokens=1000, act_gib=2.0, flops=FLOPS, hidden=64,
              delta_gib={"none": 3.0, "mixer": 2.0, "mlp": 1.0})


def _peak(tokens, counts):
    base = COMMON["act_gib"] + (COMMON["layers"] - COMMON["sweep_layers"]) * COMMON["sweep_tokens"] * 2 * 64 / 2**30
    extra = sum(n * COMMON["delta_gib"].get(p, 0.0) for p, n in counts.items())
    return COMMON["static_gib"] + tokens / COMMON["sweep_tokens"] * SAFETY * (base + extra)


def test_policy_flops_order():
    assert FLOPS["layer"] > FLOPS["mlp"] > 0 and FLOPS["layer"] > FLOPS["mixer"] > 0 and FLOPS["none"] == 0


def test_everything_kept_when_the_cap_allows_and_nothing_when_nothing_fits():
    roomy = choose(budgets=[1000], cap_gib=1e9, **COMMON)
    assert roomy.counts == {"none": 6} and roomy.recompute_flops_per_token == 0 and roomy.plan == ["none"] * 6
    assert choose(budgets=[1000], cap_gib=_peak(1000, {}) - 0.01, **COMMON) is None


def test_least_recompute_under_the_cap_matches_exhaustive_search():
    from itertools import product

    for cap in (13.0, 18.0, 25.0, 31.0):
        got = choose(budgets=[1000], cap_gib=cap, **COMMON)
        best = None
        for n in product(range(7), repeat=4):
            if sum(n) != 6:
                continue
            counts = dict(zip(("layer", "mixer", "mlp", "none"), n))
            if _peak(1000, counts) <= cap:
                cost = sum(counts[p] * FLOPS[p] for p in counts)
                best = cost if best is None else min(best, cost)
        assert got.recompute_flops_per_token == best and got.predicted_peak_gib <= cap


def test_a_smaller_budget_trades_micro_batches_for_recomputation():
    cap = 20.0
    large = choose(budgets=[1000], cap_gib=cap, **COMMON)
    both = choose(budgets=[1000, 500], cap_gib=cap, **COMMON)
    assert both.tokens == 500 and both.recompute_flops_per_token < large.recompute_flops_per_token
    tie = choose(budgets=[1000, 500], cap_gib=1e9, **COMMON)
    assert tie.tokens == 1000  # the same (no) recomputation: fewer micro-batches win
