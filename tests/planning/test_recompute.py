"""``model.checkpoint_layers=auto``'s rule (``planning/recompute.py``): the count it takes is the
first whose update fits, checked here against the plan's own update phases (``estimate`` at that
count, not the chooser's arithmetic); a bigger card checkpoints fewer layers; a card too small
for every count checkpoints every layer and the plan refuses it; ``plan`` prints the choice."""

from __future__ import annotations

import pytest

from atlas_lightning.config import compose
from atlas_lightning.planning import GIB, estimate, make_plan, planned_shape
from atlas_lightning.planning.cli import run_plan
from atlas_lightning.planning.recompute import MARGIN, choose_for_plan

#: (experiment, card GiB): the 8B on an H100 and an H200, the report's 27B hybrid on its 80 GiB
#: cards (every layer: 49,152 tokens leave no room for one kept) and on H200s.
CASES = [("h200-8b", 80.0), ("h200-8b", 141.0), ("r28-continued-cost-8gpu-n32", 80.0),
         ("r28-continued-cost-8gpu-n32", 141.0)]


def _cfg(experiment: str, *overrides: str):
    return compose([f"experiment={experiment}", "model.checkpoint_layers=auto", *overrides])


def _fits(cfg, shape, card_gib: float, count: int) -> bool:
    """The independent reading: the plan's update phases at ``count`` checkpointed layers, card
    figures (tensors with slack, plus what sits beside them), within the card less the margin."""
    plan = estimate(shape, cfg, card_gib=card_gib, linear_kernel="fla", checkpoint_layers=count)
    peak = max(plan.phase(name).card for name in ("update_actor", "update_critic"))
    return peak <= (1.0 - MARGIN) * card_gib * GIB


@pytest.mark.parametrize("experiment, card_gib", CASES)
def test_the_count_is_the_first_that_fits(experiment, card_gib):
    cfg = _cfg(experiment)
    shape = planned_shape(cfg)
    choice = choose_for_plan(shape, cfg, card_gib=card_gib, linear_kernel="fla")
    k = choice.checkpointed
    print(experiment, card_gib, choice.describe())
    assert choice.fits and 0 <= k <= shape.num_layers
    assert _fits(cfg, shape, card_gib, k)
    assert k == 0 or not _fits(cfg, shape, card_gib, k - 1)
    assert not any(_fits(cfg, shape, card_gib, j) for j in range(k))  # none fewer fits (need is not monotone)


def test_a_bigger_card_checkpoints_fewer_layers():
    cfg = _cfg("h200-8b")
    shape = planned_shape(cfg)
    counts = [choose_for_plan(shape, cfg, card_gib=card, linear_kernel="fla").checkpointed for card in (80, 96, 141)]
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1], counts


def test_a_card_too_small_checkpoints_every_layer_and_the_plan_refuses_it():
    cfg = _cfg("h200-8b")
    choice = choose_for_plan(planned_shape(cfg), cfg, card_gib=40.0, linear_kernel="fla")
    assert not choice.fits and choice.checkpointed == choice.layers == 36
    assert "does NOT fit even with every layer checkpointed" in choice.describe()
    plan = make_plan(cfg, card_gib=40.0)
    assert plan.model["checkpointed_layers"] == 36 and plan.recompute["fits"] is False
    assert any(reason.startswith("update_") for reason in plan.refusals), plan.refusals


def test_plan_prints_what_auto_chooses_for_the_configured_card(capsys):
    cfg = _cfg("h200-8b", "plan.card_gib=80")
    expected = choose_for_plan(planned_shape(cfg), cfg, card_gib=80.0, linear_kernel="fla")
    assert run_plan(cfg, write=False) == 0
    out = capsys.readouterr().out
    assert f"model.checkpoint_layers=auto: {expected.checkpointed} of 36 decoder layers checkpointed" in out
    plan = make_plan(cfg)
    assert plan.model["checkpointed_layers"] == expected.checkpointed
    assert plan.recompute["checkpointed"] == expected.checkpointed
    # the plan's update phases are those of the chosen count, within the room the note names
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


def test_a_given_count_replaces_the_choice():
    """Memory-check plans at the count its model took on the card, whatever the plan would choose."""
    plan = make_plan(_cfg("h200-8b"), card_gib=80.0, checkpoint_layers=7)
    assert plan.model["checkpointed_layers"] == 7 and plan.recompute is None
