"""The update's micro-batch count under per-size recompute plans (``ppo/micro_batches.py``):
finer cuts are taken only where the plans of smaller micro-batches replay enough less to pay for
the extra micro-steps; the packer's own cuts are what is counted."""

from __future__ import annotations

from atlas_lightning.algorithms.partition import plan_micro_batches, plan_padded_micro_batches
from atlas_lightning.ppo.micro_batches import MICRO_STEP_TOKENS, cheapest_count, layout_tokens, replayed_share

#: The 8B's tiers on an H100 with the engine asleep (``model.checkpoint_layers=auto``), rounded.
H100_8B = [(49152, 0.89), (43008, 0.84), (36864, 0.78), (30720, 0.71), (24576, 0.59), (18432, 0.41),
           (12288, 0.10), (6144, 0.0)]


def _count(lengths, shares, budget=49152, layout="packed", step_tokens=MICRO_STEP_TOKENS):
    planner = plan_padded_micro_batches if layout == "padded" else plan_micro_batches
    fewest = len(planner(lengths, budget, allow_oversized=True).micro_batches)
    return cheapest_count(lengths, fewest, layout, shares,
                          lambda n: [list(mb) for mb in planner(lengths, budget, num_micro_batches=n,
                                                                allow_oversized=True).micro_batches],
                          step_tokens=step_tokens)


def test_the_tiers_share_is_the_smallest_that_holds_the_micro_batch():
    assert replayed_share(H100_8B[::-1], 6144) == 0.0 and replayed_share(H100_8B[::-1], 6145) == 0.10
    assert replayed_share(H100_8B[::-1], 90000) == 0.89  # over the budget (one long sequence): the largest
    assert layout_tokens([300, 200, 100], "packed") == 600 and layout_tokens([300, 200, 100], "padded") == 900


def test_a_mini_batch_the_size_of_the_8b_steps_is_cut_in_three():
    """16 trajectories of 1,600 tokens (the 8B step's mini-batch, 25,600 tokens). Work in tokens:
    1 cut 25,600 x 2.71 + 1,024 = 70,400; 2 cuts of 12,800 (tier 18,432, 0.41) 63,744; 3 cuts of
    9,600 / 9,600 / 6,400 (tier 12,288, 0.10) 56,832; 4 of 6,400 57,856; 6 (all under 6,144, 0.0)
    57,344; 8 of 3,200 59,392."""
    assert _count([1600] * 16, H100_8B) == 3


def test_without_a_replay_to_save_the_fewest_micro_batches_stay():
    flat = [(49152, 0.5), (6144, 0.5)]
    assert _count([1600] * 16, flat) == 1
    assert _count([9000] * 20, flat) == len(plan_micro_batches([9000] * 20, 49152).micro_batches)
    assert _count([1600] * 16, [(49152, 0.0)]) == 1  # nothing replayed at any size


def test_never_more_micro_batches_than_sequences_or_four_times_the_fewest():
    assert _count([20000, 20000], H100_8B) <= 2
    counts = _count([3000] * 16, H100_8B)  # 48,000 tokens: one micro-batch at the fewest
    assert 1 <= counts <= 4
    assert MICRO_STEP_TOKENS > 0


def test_a_dearer_micro_step_measured_on_the_card_cuts_less():
    """With a micro-step costing 10,000 tokens of work (a card's own fit), 3 cuts (56,832 - 3,072
    + 30,000) lose to 2 (63,744 - 2,048 + 20,000) and to 1 (70,400 - 1,024 + 10,000)."""
    assert _count([1600] * 16, H100_8B, step_tokens=10_000) == 1
    assert _count([1600] * 16, H100_8B, step_tokens=0.0) >= 3
