"""``plan_padded_micro_batches``: padded cost within budget, fewest micro-batches (exhaustive check)."""

from __future__ import annotations

import random

import pytest

from atlas_lightning.algorithms.partition import plan_padded_micro_batches


def _set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in _set_partitions(rest):
        yield [[first]] + partition
        for k in range(len(partition)):
            yield partition[:k] + [[first] + partition[k]] + partition[k + 1:]


def _fewest_by_search(lengths, budget):
    return min(len(p) for p in _set_partitions(list(range(len(lengths))))
               if all(len(b) * max(lengths[i] for i in b) <= budget for b in p))


def _check_plan(plan, lengths, budget):
    seen = sorted(i for mb in plan.micro_batches for i in mb)
    assert seen == list(range(len(lengths)))
    for mb, cost in zip(plan.micro_batches, plan.token_sums):
        assert cost == len(mb) * max((lengths[i] for i in mb), default=0)
        assert cost <= budget or (len(mb) == 1 and mb[0] in plan.oversized)


@pytest.mark.parametrize("seed", range(40))
def test_fewest_micro_batches_against_exhaustive_search(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 7))]
    budget = rng.randint(max(lengths), 100)
    plan = plan_padded_micro_batches(lengths, budget)
    _check_plan(plan, lengths, budget)
    assert plan.num_micro_batches == _fewest_by_search(lengths, budget)


def test_counts_padding_not_the_sum():
    # 4 sequences of 10 + one of 40 fit a 50-token budget packed (80 > 50 needs 2), but padded
    # they cost 5 x 40 = 200: the long one must go alone and the short ones together.
    plan = plan_padded_micro_batches([10, 10, 40, 10, 10], 50)
    assert sorted(plan.micro_batches) == [(0, 1, 3, 4), (2,)]
    assert plan.token_sums == (40, 40)


def test_exact_count_splits_runs_and_pads_with_empty():
    lengths = [5, 5, 5, 5, 9]
    plan = plan_padded_micro_batches(lengths, 20, num_micro_batches=4)
    assert plan.num_micro_batches == 4
    _check_plan(plan, lengths, 20)
    many = plan_padded_micro_batches([3, 3], 10, num_micro_batches=4)
    assert sorted(many.micro_batches) == [(), (), (0,), (1,)]
    with pytest.raises(ValueError, match="num_micro_batches=1 is too few; 2 are needed"):
        plan_padded_micro_batches(lengths, 20, num_micro_batches=1)


def test_oversized_and_bad_input():
    with pytest.raises(ValueError, match="exceed max_token_len=8"):
        plan_padded_micro_batches([3, 9], 8)
    plan = plan_padded_micro_batches([3, 9, 2], 8, allow_oversized=True)
    assert plan.oversized == (1,) and (1,) in plan.micro_batches
    with pytest.raises(ValueError, match=r"seq_lens\[1\]=0"):
        plan_padded_micro_batches([3, 0], 8)
