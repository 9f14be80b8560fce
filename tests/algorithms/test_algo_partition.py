"""Token-budget micro-batches: coverage, budget, count, balance, DP equal counts, loss weights."""

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from atlas_lightning.algorithms.partition import plan_data_parallel, plan_micro_batches, token_mean_weights
from atlas_lightning.algorithms.ppo import agg_loss


def ffd_bin_count(lengths, budget):
    """Independent first-fit-decreasing: the count our packer must never exceed."""
    loads = []
    for n in sorted(lengths, reverse=True):
        for b, load in enumerate(loads):
            if load + n <= budget:
                loads[b] += n
                break
        else:
            loads.append(n)
    return len(loads)


def assert_valid(plan, lengths, budget):
    flat = [i for mb in plan.micro_batches for i in mb]
    assert sorted(flat) == list(range(len(lengths)))  # each sequence exactly once
    for mb, tokens in zip(plan.micro_batches, plan.token_sums):
        assert tokens == sum(lengths[i] for i in mb)
        assert tokens <= budget or (len(mb) == 1 and mb[0] in plan.oversized)
        assert list(mb) == sorted(mb)


lengths_strategy = st.lists(st.integers(min_value=1, max_value=100), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_strategy, budget=st.integers(min_value=100, max_value=400))
def test_plan_is_valid_and_never_worse_than_ffd(lengths, budget):
    plan = plan_micro_batches(lengths, budget)
    assert_valid(plan, lengths, budget)
    assert math.ceil(sum(lengths) / budget) <= plan.num_micro_batches <= ffd_bin_count(lengths, budget)
    assert plan == plan_micro_batches(list(lengths), budget)  # deterministic


def test_reaches_the_lower_bound_and_balances():
    plan = plan_micro_batches([6, 4, 6, 4, 5, 5], 10)
    assert plan.token_sums == (10, 10, 10)
    # FFD would pack 100 x 10 under 450 as 400/400/200; balanced: 400/300/300.
    plan = plan_micro_batches([100] * 10, 450)
    assert plan.token_sums == (400, 300, 300)
    assert [len(mb) for mb in plan.micro_batches] == [4, 3, 3]


def test_finds_fewer_micro_batches_than_first_fit_decreasing():
    # FFD packs 50+43 | 32+27+26 | 18 (3 micro-batches); 2 suffice: 50+32+18 | 43+27+26.
    lengths = [50, 43, 27, 26, 18, 32]
    assert ffd_bin_count(lengths, 100) == 3
    plan = plan_micro_batches(lengths, 100)
    assert plan.num_micro_batches == 2
    assert_valid(plan, lengths, 100)


def test_a_production_sized_mini_batch_meets_the_lower_bound():
    rng = random.Random(7)
    lengths = [rng.randint(300, 16000) for _ in range(256)]  # 8 questions x 32 samples
    plan = plan_micro_batches(lengths, 49152)
    assert plan.num_micro_batches == math.ceil(sum(lengths) / 49152)
    assert_valid(plan, lengths, 49152)
    assert max(plan.token_sums) - min(plan.token_sums) < 2000  # balanced to a few percent


def test_oversized_sequences_raise_or_get_their_own_micro_batch():
    with pytest.raises(ValueError, match=r"max_token_len=500: #2 \(700 tokens\)"):
        plan_micro_batches([100, 200, 700, 50], 500)
    plan = plan_micro_batches([100, 200, 700, 50, 600], 500, allow_oversized=True)
    assert plan.oversized == (2, 4)
    assert (2,) in plan.micro_batches and (4,) in plan.micro_batches
    assert_valid(plan, [100, 200, 700, 50, 600], 500)
    assert plan.num_micro_batches == 3


def test_exact_count_pads_with_empty_micro_batches():
    plan = plan_micro_batches([30, 20], 100, num_micro_batches=4)
    assert plan.micro_batches == ((0,), (1,), (), ())
    assert plan.token_sums == (30, 20, 0, 0)
    # Longest-first over 2 bins overflows here (53+31+17 = 101); the exact count falls back to a feasible packing.
    plan = plan_micro_batches([53, 47, 32, 31, 17, 17], 100, num_micro_batches=2)
    assert plan.num_micro_batches == 2
    assert_valid(plan, [53, 47, 32, 31, 17, 17], 100)
    with pytest.raises(ValueError, match="too few"):
        plan_micro_batches([60, 60, 60], 100, num_micro_batches=2)


@pytest.mark.parametrize(
    "lengths,budget,message",
    [([10, 0], 100, r"seq_lens\[1\]=0"), ([10, 2.5], 100, r"seq_lens\[1\]=2.5"), ([10], 0, "max_token_len=0")],
)
def test_bad_input_is_named(lengths, budget, message):
    with pytest.raises(ValueError, match=message):
        plan_micro_batches(lengths, budget)


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(min_value=1, max_value=120), min_size=0, max_size=50), world_size=st.integers(1, 6))
def test_data_parallel_plan_has_equal_counts_and_balanced_ranks(lengths, world_size):
    budget = 200
    plan = plan_data_parallel(lengths, budget, world_size)
    assert plan.world_size == world_size
    assert len({len(rank) for rank in plan.micro_batches}) == 1  # the same count on every rank
    flat = [i for rank in plan.micro_batches for mb in rank for i in mb]
    assert sorted(flat) == list(range(len(lengths)))
    for r, rank in enumerate(plan.micro_batches):
        assert sorted(i for mb in rank for i in mb) == list(plan.rank_indices[r])
        for mb, tokens in zip(rank, plan.token_sums[r]):
            assert tokens == sum(lengths[i] for i in mb) <= budget
    loads = [sum(lengths[i] for i in r) for r in plan.rank_indices]
    if lengths:
        assert max(loads) - min(loads) <= max(lengths)  # longest-first guarantee, kept by rebalancing
        # No rank needs fewer than the count, so no rank could have used fewer micro-batches overall.
        assert plan.num_micro_batches == max(plan_micro_batches([lengths[i] for i in r], budget).num_micro_batches for r in plan.rank_indices if r)


def test_more_ranks_than_sequences_gives_empty_micro_batches():
    plan = plan_data_parallel([50, 40], 100, 3)
    assert plan.num_micro_batches == 1
    assert sorted(plan.micro_batches) == sorted([((0,),), ((1,),), ((),)])
    with pytest.raises(ValueError, match="world_size=0"):
        plan_data_parallel([50], 100, 0)


def test_token_mean_weights_reproduce_the_global_token_mean():
    rng = random.Random(0)
    n = 37
    response_lengths = [rng.randint(1, 30) for _ in range(n)]
    prompt_lengths = [rng.randint(5, 20) for _ in range(n)]
    width = max(response_lengths)
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(n, width, generator=g, dtype=torch.float64)
    mask = torch.zeros(n, width, dtype=torch.float64)
    for i, length in enumerate(response_lengths):
        mask[i, :length] = 1
        mask[i, rng.randint(0, length - 1)] = 0  # a tool token inside the response
    mask[3] = 0  # a sequence without loss tokens
    loss_tokens = [int(x) for x in mask.sum(-1).tolist()]
    world_size = 3
    plan = plan_data_parallel([p + r for p, r in zip(prompt_lengths, response_lengths)], 120, world_size)
    weights = token_mean_weights(plan.micro_batches, loss_tokens)

    global_mean = (loss * mask).sum().item() / mask.sum().item()
    weighted = 0.0
    for rank, rank_weights in zip(plan.micro_batches, weights):
        for mb, weight in zip(rank, rank_weights):
            if weight == 0.0:
                continue
            index = list(mb)
            micro_mean = ((loss[index] * mask[index]).sum() / mask[index].sum()).item()
            weighted += weight * micro_mean
    assert weighted == pytest.approx(global_mean, rel=1e-12)
    assert sum(map(sum, weights)) == pytest.approx(1.0)

    # The same scaling as agg_loss with the global token count and dp_size (what FSDP averages).
    total = int(mask.sum().item())
    per_rank = [
        sum(agg_loss(loss[list(mb)], mask[list(mb)], "token-mean", dp_size=world_size, batch_num_tokens=total).item() for mb in rank if mb)
        for rank in plan.micro_batches
    ]
    assert sum(per_rank) / world_size == pytest.approx(global_mean, rel=1e-12)


def test_token_mean_weights_reject_bad_input():
    with pytest.raises(ValueError, match="no loss tokens"):
        token_mean_weights([[(0, 1)]], [0, 0])
    with pytest.raises(ValueError, match=r"micro_batches\[0\]\[1\] holds index 5"):
        token_mean_weights([[(0,), (5,)]], [3])
