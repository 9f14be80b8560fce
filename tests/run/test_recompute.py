"""``model.checkpoint_layers=auto`` resolved where the model is built (``run/recompute.py``,
``PPOModule.configure_model``): on a card, the plan's policies for the memory free there (the card
itself stood in for by what ``free_on_card`` returns); off a card, every layer; memory-check keeps
room for the engine it builds later; the run's config keeps ``auto``; the choice is said once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from atlas_lightning.config import compose
from atlas_lightning.planning import GIB, planned_shape
from atlas_lightning.planning.estimate import ENGINE_ASLEEP_GIB, Inputs
from atlas_lightning.planning import recompute as planning_recompute
from atlas_lightning.planning.recompute import beside_trainer, choose
from atlas_lightning.ppo.module import PPOModule
from atlas_lightning.run import recompute
from atlas_lightning.run.recompute import CheckpointLayersFor

CUDA = torch.device("cuda", 0)  # a device object only: nothing is placed on it here
#: An H100 as the 8B's fit found it: 79.2 GiB, the sleeping engine and the context holding ~5.
CARD, FREE = 79.2 * GIB, 74.2 * GIB


def _cfg(*overrides: str):
    return compose(["experiment=h200-8b", *overrides])


def _card(monkeypatch, free: float, card: float = CARD, tiers: bool = False) -> None:
    """The card as ``free_on_card`` would find it; ``tiers``: plan every sixteenth of the budget
    too, as fit does (else the budget's plan alone: the tests about it need no more)."""
    monkeypatch.setattr(recompute, "free_on_card", lambda device: (free, card))
    if not tiers:
        monkeypatch.setattr(planning_recompute, "TIER_SHARES", (1.0,))


def test_on_a_card_the_policies_are_the_plans_for_the_memory_free_there(monkeypatch, capsys):
    cfg = _cfg()
    assert cfg.model.checkpoint_layers == "auto"  # the experiment asks for it
    _card(monkeypatch, FREE)
    resolver = CheckpointLayersFor(cfg)
    plan = resolver(CUDA)
    expected = choose(planned_shape(cfg), Inputs.from_config(cfg), free=FREE, card=CARD, linear_kernel="fla")
    assert expected.fits and plan == expected.plan == resolver.choice.plan
    assert 0 < plan.count("layer") < 36  # the 8B at 49,152 tokens: some layers checkpointed whole, not all
    err = capsys.readouterr().err
    assert err.count("model.checkpoint_layers=auto:") == 1 and err.count("auto per micro-batch:") == 1
    assert f"{plan.count('layer')} of 36 decoder layers checkpointed whole" in err
    assert "74.20 GiB free of a 79.2 GiB card" in err


def test_less_free_memory_replays_more(monkeypatch):
    replayed = []
    for free in (FREE, FREE - 8 * GIB, FREE - 16 * GIB):
        _card(monkeypatch, free)
        resolver = CheckpointLayersFor(_cfg())
        resolver(CUDA)
        replayed.append(resolver.choice.replayed)
    assert replayed == sorted(replayed) and replayed[0] < replayed[-1], replayed


def test_a_card_too_full_checkpoints_every_layer_and_warns(monkeypatch, capsys):
    _card(monkeypatch, 30 * GIB)
    assert CheckpointLayersFor(_cfg())(CUDA) == ("layer",) * 36
    assert "does NOT fit even with every layer checkpointed" in capsys.readouterr().err


def test_memory_check_keeps_room_for_the_engine_it_builds_after_the_model(monkeypatch):
    """Memory-check finds the card without its engine (built at train start): the plan's figure
    for the engine asleep is kept, so it takes the plan fit takes beside that engine asleep."""
    cfg = _cfg()
    assert beside_trainer(cfg, CARD) == ENGINE_ASLEEP_GIB * GIB  # colocated, sleep mode
    _card(monkeypatch, FREE)
    in_fit = CheckpointLayersFor(cfg)(CUDA)
    _card(monkeypatch, FREE + ENGINE_ASLEEP_GIB * GIB)
    assert CheckpointLayersFor(cfg, engine_to_come=True, verb="memory-check")(CUDA) == in_fit


@pytest.mark.parametrize("override", ["model.layer_recompute=[" + ",".join(["mixer"] * 36) + "]",
                                      "model.gradient_checkpointing=false"])
def test_nothing_is_measured_where_auto_has_nothing_to_choose(override, monkeypatch):
    monkeypatch.setattr(recompute, "free_on_card", lambda device: pytest.fail("measured"))
    assert CheckpointLayersFor(_cfg(override))(CUDA) is None


def test_the_module_builds_the_resolved_policies_and_the_run_keeps_auto():
    cfg = _cfg()
    chosen = ("layer",) * 5 + ("mixer",) * 30 + ("none",)
    module = PPOModule(cfg, checkpoint_layers_for=lambda device, random_base: chosen)
    resolved = module._model_config(CUDA)
    assert resolved.checkpoint_layers is None and tuple(resolved.layer_recompute) == chosen
    assert resolved.path == cfg.model.path
    assert cfg.model.checkpoint_layers == "auto"
    assert PPOModule(cfg)._model_config(CUDA) is cfg.model  # no resolver: left to the model (every layer)


def test_auto_on_cpu_builds_every_layer_checkpointed_and_says_so(cfg_of, capsys):
    cfg = cfg_of("model.checkpoint_layers=auto", "model.gradient_checkpointing=true")
    module = PPOModule(cfg, checkpoint_layers_for=CheckpointLayersFor(cfg))
    module._trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")), datamodule=None)
    module.configure_model()
    layers = len(module.model.decoder_layers())
    assert module.model.checkpointed_layers == layers and module.model.layer_recompute == ["layer"] * layers
    assert "model.checkpoint_layers=auto on cpu: every decoder layer checkpointed" in capsys.readouterr().err


def test_on_a_card_smaller_micro_batches_get_their_own_plans(monkeypatch, capsys):
    """The resolver's tiers (``planning.recompute.choose_tiers``) for the module to give the model:
    the budget's plan first, each smaller micro-batch's replaying no more; said on one line."""
    cfg = _cfg()
    _card(monkeypatch, FREE, tiers=True)
    resolver = CheckpointLayersFor(cfg)
    plan = resolver(CUDA)
    assert resolver.tiers[0][:2] == (49152, plan) and [t for t, _, _ in resolver.tiers] == [3072 * k for k in range(16, 0, -1)]
    kept = [sum(p != "layer" for p in tier) for _, tier, _ in resolver.tiers]
    shares = [share for _, _, share in resolver.tiers]
    assert shares == sorted(shares, reverse=True) and 0 <= shares[-1] < shares[0] <= 1
    assert kept == sorted(kept) and kept[-1] > kept[0], kept
    err = capsys.readouterr().err
    assert "model.checkpoint_layers=auto per micro-batch: <= 49,152 tokens" in err and "; <= 9,216 tokens: 36 none" in err
    assert "<= 6,144 tokens" not in err  # the same plan as 9,216's: named once


def test_a_card_too_full_gets_no_tiers(monkeypatch):
    _card(monkeypatch, 30 * GIB)
    resolver = CheckpointLayersFor(_cfg())
    resolver(CUDA)
    assert resolver.tiers == []


def test_each_update_micro_batch_runs_the_plan_of_the_largest_across_ranks(monkeypatch):
    """``PPOModule._timed_micro_step`` / ``_recompute_for``: the model's tier for the largest
    micro-batch over ranks (the layout's count: packed sums lengths, padded counts rows x longest);
    nothing without tiers."""
    from atlas_lightning import distributed as dist_utils
    from atlas_lightning.ppo.micro_timing import MicroTimer

    asked = []
    module = PPOModule(_cfg())
    module.model = SimpleNamespace(recompute_tiers=[(10, ["none"])], sequence_layout="packed",
                                   use_recompute_for=lambda tokens: asked.append(tokens) or ["none"])
    module.recompute_shares = [(1000, 0.25)]
    module._micro_step = lambda role, data, indices, total, world: {}
    data = SimpleNamespace(seqs=[[0] * 300, [0] * 200, [0] * 100, [0] * 900, [0] * 5000])
    timer, replays = MicroTimer("cpu", 1000), {}

    def step(indices):
        return module._timed_micro_step("actor", data, indices, 1.0, 2, timer, replays)

    monkeypatch.setattr(dist_utils, "all_reduce_max", lambda values: [max(values[0], 700.0)])  # another rank's 700
    step([0, 1])
    step([3])
    assert asked == [700, 900] and replays["perf/actor_mixers_replayed"] == [0, 0]
    module.model.sequence_layout = "padded"
    step([0, 1, 2])
    assert asked[-1] == 900  # 3 rows of the longest, 300
    assert timer._work == [500 * 2.25, 900 * 2.25, 900 * 2.25]  # the layout's tokens, at the tier's share
    module.model.recompute_tiers = []
    step([4])
    assert len(asked) == 3 and timer._work[-1] == 5000 * 2.0  # no tiers: nothing replayed, no collective
