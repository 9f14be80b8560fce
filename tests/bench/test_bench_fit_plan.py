"""The update benchmark's recomputation is ``fit``'s (``bench/update.py``: ``fit_run_config``,
``fit_plan``, ``fit_budget_plan``; ``OursRunner``): the plans are the ones ``fit``'s resolver
(``run/recompute.py``) takes for the same config and free memory, the batch's budget is the
largest whose plan fits, and our runner cuts an update's micro-batches as ``PPOModule`` does and
runs each under the plan of its size (what it replays counted at each layer's first projection of
the mixer and of the MLP, as ``tests/models/test_recompute.py`` does)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from atlas_lightning.algorithms.partition import plan_micro_batches
from atlas_lightning.bench import update_bench
from atlas_lightning.bench.report import markdown
from atlas_lightning.bench.shapes import shape_by_name, transformers_config
from atlas_lightning.bench.update import (OursRunner, fit_budget_plan, fit_model_config, fit_plan, fit_run_config,
                                          plan_record)
from atlas_lightning.bench.workload import ppo_inputs, sample_batch
from atlas_lightning.planning import GIB, shape_from_config
from atlas_lightning.planning import recompute as planning_recompute
from atlas_lightning.planning.estimate import Inputs
from atlas_lightning.planning.recompute import choose, choose_tiers
from atlas_lightning.ppo.micro_batches import MICRO_STEP_TOKENS
from atlas_lightning.ppo.module import PPOModule
from atlas_lightning.run import recompute
from atlas_lightning.run.recompute import CheckpointLayersFor, tier_shares, trainer_linear_kernel

CPU = torch.device("cpu")
CARD = 79.2 * GIB
#: Fewer tiers than fit's sixteenths: the same rule, a quarter of the planning time.
SHARES = (1.0, 0.75, 0.5, 0.25)


@pytest.fixture
def quarters(monkeypatch):
    monkeypatch.setattr(planning_recompute, "TIER_SHARES", SHARES)


def test_the_config_is_the_one_fit_would_plan():
    cfg = fit_run_config(64, 1024, 32768, elementwise_kernels="torch")
    assert cfg.model.checkpoint_layers == "auto" and cfg.model.layer_recompute is None
    assert cfg.model.lora.rank == 64 and cfg.model.logprob_chunk_tokens == 1024 and cfg.model.gradient_checkpointing
    assert cfg.algorithm.ppo_max_token_len_per_gpu == cfg.algorithm.forward_max_token_len_per_gpu == 32768
    assert Inputs.from_config(cfg).world == 1 and cfg.model.elementwise_kernels == "torch"
    assert planning_recompute.nothing_to_choose(cfg.model) is None  # auto chooses


@pytest.mark.parametrize("name, layers, free", [("dense8b", 12, 40 * GIB), ("qwen3_6_27b", 8, 75 * GIB)])
def test_the_bench_plans_as_fit_does(name, layers, free, quarters, monkeypatch):
    """``fit_plan`` is ``choose_tiers`` on the config's inputs, and what fit's resolver takes
    on a card with that much free (its random base the benchmark's)."""
    cfg = fit_run_config(64, 1024, 49152)
    random_base = transformers_config(shape_by_name(name), layers)
    tiers = fit_plan(cfg, random_base, free=free, card=CARD)
    shape = shape_from_config(random_base.to_dict(), where="test")
    assert shape.num_layers == layers
    assert tiers == choose_tiers(shape, Inputs.from_config(cfg), free=free, card=CARD,
                                 linear_kernel=trainer_linear_kernel(cfg, shape))
    assert tiers[0].fits and {"layer", "none"} & set(tiers[0].plan) and len(set(tiers[0].plan)) > 1, tiers[0].counts
    monkeypatch.setattr(recompute, "free_on_card", lambda device: (free, CARD))
    resolver = CheckpointLayersFor(cfg, verb="bench")
    assert resolver(torch.device("cuda", 0), random_base) == tiers[0].plan  # a device object only
    assert resolver.tiers == tier_shares(tiers) and len(resolver.tiers) == len(SHARES)
    record = plan_record(tiers, cap_gib=None)
    assert record["plan"] == list(tiers[0].plan) and record["fits"] and record["tokens"] == 49152
    assert record["need_gib"] == tiers[0].need / GIB and record["counts"] == tiers[0].counts
    assert record["tiers"].startswith("model.checkpoint_layers=auto per micro-batch: <= 49,152 tokens")
    assert [t["tokens"] for t in record["tier_plans"]] == [t.tokens for t in tiers]
    json.dumps(record)


def test_the_batch_budget_is_the_largest_whose_plan_fits(quarters):
    budgets = [49152, 32768, 16384, 8192]
    random_base = transformers_config(shape_by_name("dense8b"), 8)
    shape = shape_from_config(random_base.to_dict(), where="test")

    def config_for(budget):
        return fit_run_config(64, 1024, budget)

    def fits(budget, free):
        return choose(shape, Inputs.from_config(config_for(budget)), free=free, card=CARD, linear_kernel="fla").fits

    free = 20 * GIB
    assert [fits(b, free) for b in budgets] == [False, False, True, True]  # the case the rule is about
    budget, tiers, tried = fit_budget_plan(budgets[::-1], config_for, random_base, free=free, card=CARD)
    assert budget == 16384 and tiers == fit_plan(config_for(16384), random_base, free=free, card=CARD)
    assert [(t["tokens"], t["fits"]) for t in tried] == [(49152, False), (32768, False), (16384, True)]
    budget, tiers, _ = fit_budget_plan(budgets, config_for, random_base, free=2 * GIB, card=CARD)
    assert budget == 8192 and not tiers[0].fits and tiers[0].plan == ("layer",) * 8 and tier_shares(tiers) == []


def _inputs(scale: float = 1 / 32):
    return ppo_inputs(sample_batch(0, 6, scale=scale), shape_by_name("tiny").vocab_size, CPU, seed=0)


def _runner(tiers, budget):
    return OursRunner(fit_model_config(4, 64, dtype="float32"), transformers_config(shape_by_name("tiny")), budget,
                      device=CPU, tiers=tiers)


def test_the_update_is_cut_as_the_ppo_module_cuts_it():
    """With tiers, the count of least predicted work (``PPOModule._plan`` on one rank); without,
    the fewest; forward passes the fewest whatever the tiers (the mix's full lengths: a
    micro-step's fixed cost is worth cutting finer only beside thousands of tokens)."""
    inputs = _inputs(scale=1.0)
    lengths = [int(s.numel()) for s in inputs.sequences]
    budget = 2 * max(lengths)
    tiers = [(budget, ["layer"] * 4, 1.0), (budget // 2, ["none"] * 4, 0.0)]
    runner = _runner(tiers, budget)
    module = SimpleNamespace(model=runner.model, recompute_shares=runner.recompute_shares,
                             micro_step_tokens=MICRO_STEP_TOKENS)
    cut = runner.micro_batches(inputs, update=True)
    assert cut == PPOModule._plan(module, lengths, budget, update=True)
    fewest = plan_micro_batches(lengths, budget, allow_oversized=True).micro_batches
    assert len(cut) > len(fewest)  # here the finer cut replays less than it costs in micro-steps
    assert runner.micro_batches(inputs) == PPOModule._plan(module, lengths, budget) and len(runner.micro_batches(inputs)) == len(fewest)
    plain = _runner((), budget)
    assert plain.micro_batches(inputs, update=True) == [list(mb) for mb in fewest] and not plain.model.recompute_tiers
    # a later step of fit, its micro-step cost measured: the benchmark cuts as fit then cuts
    runner.micro_step_tokens = module.micro_step_tokens = 0.0
    assert runner.micro_batches(inputs, update=True) == PPOModule._plan(module, lengths, budget, update=True)


def test_ours_runs_each_micro_batch_under_its_sizes_plan():
    from atlas_lightning.models.recompute import mixer_of

    inputs = _inputs()
    lengths = [int(s.numel()) for s in inputs.sequences]
    budget = 2 * max(lengths)
    # equal shares: the cut is the fewest micro-batches, whatever the tiers' sizes
    sizes = sorted(sum(lengths[i] for i in mb) for mb in plan_micro_batches(lengths, budget).micro_batches)
    assert sizes[0] < sizes[-1]
    small, large = ["none", "mixer", "none", "layer"], ["layer", "mixer", "layer", "layer"]
    runner = _runner([(budget, large, 1.0), (sizes[0], small, 1.0)], budget)
    assert runner.model.layer_recompute == ["layer"] * 4  # the build's plan until a micro-batch switches it
    log: list = []
    for index, layer in enumerate(runner.model.decoder_layers()):
        for part, module in (("mixer", mixer_of(layer).q_proj), ("mlp", layer.mlp.gate_proj)):
            module.register_forward_hook(lambda *args, key=(index, part): log.append(key))
    switch = runner.use_recompute_for
    runner.use_recompute_for = lambda inputs, indices: log.append(("step", switch(inputs, indices))) or log[-1][1]
    runner.train_pass("actor", inputs)
    steps, plans = [], []
    for event in log:  # each micro-step: its plan, then its forward and its backward's replays
        if event[0] == "step":
            plans.append(event[1])
            steps.append({})
        else:
            steps[-1][event] = steps[-1].get(event, 0) + 1
    assert small in plans and large in plans and len(plans) == len(sizes)
    for plan, calls in zip(plans, steps):
        replays = [(calls[(i, "mixer")] - 1, calls[(i, "mlp")] - 1) for i in range(4)]
        assert replays == [(int(p in ("layer", "mixer")), int(p == "layer")) for p in plan], (plan, replays)
    assert {(s["layers_replayed"], s["mixers_replayed"]) for s in runner.take_replays()} == {(1, 1), (3, 1)}
    assert runner.replays == []


def test_a_tiny_run_on_a_sized_card_runs_the_plans_and_reports_them(tmp_path, monkeypatch, quarters):
    """On CPU no card is sized; with the card's memory stood in for, the whole path runs: the
    full update and the batch under auto's plans, recorded and printed."""
    card = 1 * GIB
    monkeypatch.setattr(update_bench.Bench, "_card_memory", lambda self: (1.05 * GIB + 8.8 * 2**20, card))
    out = tmp_path / "bench.json"
    assert update_bench.main(["--tiny", "--models", "tiny", "--sweep-layers", "0", "--reps", "1", "--tokens", "1024",
                              "--batch-sequences", "6", "--batch-budgets", "1024,600", "--paths", "ours",
                              "--sections", "update,batch", "--out", str(out)]) == 0
    model = json.loads(out.read_text())["models"]["tiny"]
    choice = model["recompute_choice"]
    assert choice["fits"] and choice["tokens"] == 1024 and set(choice["counts"]) == {"layer", "mixer"}
    assert model["ours"]["recompute"] == "auto" and model["ours"]["options"]["layer_recompute"] == choice["plan"]
    assert model["ours"]["options"]["recompute_tiers"] == len(SHARES) and model["ours"]["update"]["recompute_per_micro_step"]
    batch = model["batch"]
    assert batch["choice"]["tokens"] == 1024 and batch["ours"]["attempts"][0]["attempt"] == "auto"
    assert batch["ours"]["update"]["recompute_per_micro_step"]
    text = markdown(json.loads(out.read_text()))
    assert "Our recomputation: model.checkpoint_layers=auto" in text and "Ours' plan (model.checkpoint_layers=auto" in text
    assert "1,024 tokens: layer x" in text and "smaller micro-batches: <= 768" in text
