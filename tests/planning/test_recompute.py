"""``model.checkpoint_layers=auto``'s rule (``planning/recompute.py``): one recompute policy a
decoder layer, checked here against the plan's own update phases (``estimate`` at that plan, not
the chooser's arithmetic): the plan fits, no layer could take its next policy and still fit, and
on a short stack no plan of the same policies replays less (brute force over the counts); a bigger
card replays less; a card too small for every layer checkpointed whole keeps that plan and the
plan refuses it; ``plan`` prints the choice."""

from __future__ import annotations

from dataclasses import replace
from itertools import product

import pytest

from atlas_lightning.config import compose
from atlas_lightning.planning import GIB, estimate, make_plan, planned_shape
from atlas_lightning.planning.cli import run_plan
from atlas_lightning.planning.estimate import Inputs
from atlas_lightning.planning.recompute import MARGIN, choose, choose_for_plan, choose_tiers, replayed_flops

#: (experiment, card GiB): the 8B on an H100 and an H200, at the report's 49,152 tokens and at
#: 16,384; the report's 27B hybrid on its 80 GiB cards and on H200s.
CASES = [("h200-8b", 80.0, ()), ("h200-8b", 141.0, ()), ("h200-8b", 80.0, ("algorithm.ppo_max_token_len_per_gpu=16384",)),
         ("r28-continued-cost-8gpu-n32", 80.0, ()), ("r28-continued-cost-8gpu-n32", 141.0, ())]
#: Each policy's next, the way a layer climbs from ``layer`` (what a kept layer could become).
NEXT = {"layer": ("mixer", "none"), "mixer": ("none",), "none": ()}


def _cfg(experiment: str, *overrides: str):
    return compose([f"experiment={experiment}", "model.checkpoint_layers=auto", *overrides])


def _fits(cfg, shape, card_gib: float, plan) -> bool:
    """The independent reading: the plan's update phases at ``plan``, card figures (tensors with
    slack, plus what sits beside them), within the card less the margin."""
    estimated = estimate(shape, cfg, card_gib=card_gib, linear_kernel="fla", layer_recompute=list(plan))
    peak = max(estimated.phase(name).card for name in ("update_actor", "update_critic"))
    return peak <= (1.0 - MARGIN) * card_gib * GIB


def _replayed(shape, plan) -> float:
    return sum(replayed_flops(shape, kind, p) for kind, p in zip(shape.layer_types, plan))


@pytest.mark.parametrize("experiment, card_gib, overrides", CASES)
def test_the_plan_fits_and_no_layer_could_keep_more(experiment, card_gib, overrides):
    cfg = _cfg(experiment, *overrides)
    shape = planned_shape(cfg)
    choice = choose_for_plan(shape, cfg, card_gib=card_gib, linear_kernel="fla")
    print(experiment, card_gib, overrides, choice.describe())
    assert choice.fits and len(choice.plan) == shape.num_layers
    assert _fits(cfg, shape, card_gib, choice.plan)
    # one layer of each (kind, policy): the others of a pair would weigh the same
    firsts = {}
    for index, pair in enumerate(zip(shape.layer_types, choice.plan)):
        firsts.setdefault(pair, index)
    for index in firsts.values():
        policy = choice.plan[index]
        for after in NEXT[policy]:
            trial = list(choice.plan)
            trial[index] = after
            if _replayed(shape, trial) < _replayed(shape, choice.plan):
                assert not _fits(cfg, shape, card_gib, trial), (index, policy, after)


@pytest.mark.parametrize("card_gib", [36.0, 52.0])  # chosen: 9 layer + 1 none; 4 layer + 6 mixer
def test_on_a_short_stack_no_plan_replays_less(card_gib):
    """A 10-layer 8B stack: every count of layer / mixer / none (``auto``'s policies) that fits
    replays at least what the choice replays."""
    cfg = _cfg("h200-8b")
    shape = replace(planned_shape(cfg), layer_types=("full_attention",) * 10)
    choice = choose_for_plan(shape, cfg, card_gib=card_gib, linear_kernel="fla")
    assert choice.fits and _fits(cfg, shape, card_gib, choice.plan)
    best = None
    for mixer, none in product(range(11), repeat=2):
        if mixer + none > 10:
            continue
        plan = ["layer"] * (10 - mixer - none) + ["mixer"] * mixer + ["none"] * none
        if _fits(cfg, shape, card_gib, plan) and (best is None or _replayed(shape, plan) < best):
            best = _replayed(shape, plan)
    print(card_gib, choice.counts, _replayed(shape, choice.plan) / 1e9, best / 1e9)
    assert _replayed(shape, choice.plan) <= best * (1 + 1e-9)
    assert 0 < choice.replayed < choice.replayed_all_layers  # the card leaves something to choose


def test_smaller_micro_batches_get_plans_of_their_own_that_replay_less():
    """The tiers (``choose_tiers``): the budget's choice first, then 15/16 of it down to 1/16, each
    the plan ``choose`` gives at that size, each fitting at its own size, replaying no more than
    the larger one's."""
    cfg = _cfg("h200-8b")
    shape, inputs = planned_shape(cfg), Inputs.from_config(cfg)
    free, card = 78.5 * GIB, 80.0 * GIB
    tiers = choose_tiers(shape, inputs, free=free, card=card, linear_kernel="fla")
    assert [t.tokens for t in tiers] == [49152 * k // 16 for k in range(16, 0, -1)]
    assert tiers[0] == choose(shape, inputs, free=free, card=card, linear_kernel="fla")
    assert all(t.fits and t.need <= t.room for t in tiers)
    replayed = [t.replayed for t in tiers]
    assert replayed == sorted(replayed, reverse=True) and replayed[0] > replayed[1], replayed
    for tier in (tiers[1], tiers[8], tiers[-1]):  # the plan's own reading, at three sizes
        at_size = _cfg("h200-8b", f"algorithm.ppo_max_token_len_per_gpu={tier.tokens}", "plan.card_gib=80")
        assert _fits(at_size, shape, 80.0, tier.plan)


def test_a_bigger_card_replays_less():
    cfg = _cfg("h200-8b")
    shape = planned_shape(cfg)
    replayed = [choose_for_plan(shape, cfg, card_gib=card, linear_kernel="fla").replayed for card in (80, 96, 141)]
    assert replayed == sorted(replayed, reverse=True) and replayed[0] > replayed[-1], replayed


def test_a_card_too_small_checkpoints_every_layer_and_the_plan_refuses_it():
    cfg = _cfg("h200-8b")
    choice = choose_for_plan(planned_shape(cfg), cfg, card_gib=40.0, linear_kernel="fla")
    assert not choice.fits and choice.plan == ("layer",) * 36 and choice.checkpointed == 36
    assert "does NOT fit even with every layer checkpointed" in choice.describe()
    plan = make_plan(cfg, card_gib=40.0)
    assert plan.model["checkpointed_layers"] == 36 and plan.recompute["fits"] is False
    assert any(reason.startswith("update_") for reason in plan.refusals), plan.refusals


def test_plan_prints_what_auto_chooses_for_the_configured_card(capsys):
    cfg = _cfg("h200-8b", "plan.card_gib=80")
    expected = choose_for_plan(planned_shape(cfg), cfg, card_gib=80.0, linear_kernel="fla")
    assert run_plan(cfg, write=False) == 0
    out = capsys.readouterr().out
    assert f"model.checkpoint_layers=auto: {expected.checkpointed} of 36 decoder layers checkpointed whole" in out
    plan = make_plan(cfg)
    assert plan.model["checkpointed_layers"] == expected.checkpointed
    assert plan.recompute["plan"] == list(expected.plan)
    # the plan's update phases are those of the chosen policies, within the room the note names
    assert max(plan.phase(n).card for n in ("update_actor", "update_critic")) <= (1 - MARGIN) * 80 * GIB


@pytest.mark.parametrize("override, note", [
    ("trainer.accelerator=cpu", "on CPU: every layer checkpointed"),
    ("model.layer_recompute=[" + ",".join(["layer"] * 36) + "]", "model.layer_recompute is set and decides"),
    ("model.gradient_checkpointing=false", "gradient checkpointing is off"),
])
def test_auto_chooses_nothing_where_there_is_nothing_to_choose(override, note):
    plan = make_plan(_cfg("h200-8b", override))
    assert plan.recompute is None
    assert any(note in line for line in plan.notes), plan.notes
    if override.startswith("trainer"):
        assert plan.model["checkpointed_layers"] == 36


def test_given_policies_replace_the_choice():
    """Memory-check plans at the policies its model took on the card, whatever the plan would choose."""
    given = ["layer"] * 7 + ["mixer"] * 29
    plan = make_plan(_cfg("h200-8b"), card_gib=80.0, layer_recompute=given)
    assert plan.model["checkpointed_layers"] == 7 and plan.recompute is None
    assert plan.model["recompute"] == {"layer": 7, "mixer": 29}
