"""One LoRA shape source: the plan resolves the adapters' shapes once (its terms and the engine's
rank from the same resolution), and the memory check builds every engine (colocated and the
separate layout's server) for the actor shape the run's start-up resolved."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from atlas_lightning.config import compose
from atlas_lightning.store.lora_shapes import LoraShape


def _cfg(tiny_model_dir, tmp_path, *extra):
    return compose(["experiment=tiny-cpu", f"model.path={tiny_model_dir}", f"data.root={tmp_path}",
                    f"paths.root={tmp_path}", "rollout.weight_sync=lora", *extra])


def test_the_plan_resolves_the_lora_shapes_once(tiny_model_dir, tmp_path, monkeypatch):
    import sys

    from atlas_lightning.planning import estimate, read_model_shape
    from atlas_lightning.rollout.engines import args as args_module
    from atlas_lightning.store.lora_shapes import lora_shapes_or_config

    calls = []

    def counted(cfg):
        calls.append(cfg)
        return lora_shapes_or_config(cfg)

    plan_module = sys.modules["atlas_lightning.planning.estimate"]  # the package exports a function of its name
    monkeypatch.setattr(plan_module, "lora_shapes_or_config", counted)
    monkeypatch.setattr(args_module, "lora_shapes_or_config", counted)
    plan = estimate(read_model_shape(tiny_model_dir), _cfg(tiny_model_dir, tmp_path))
    assert len(calls) == 1
    assert plan.model["lora"]["actor"]


class _Built(Exception):
    """Raised by the stand-in ``build_engine`` once it saw its arguments."""


@pytest.fixture
def built(monkeypatch):
    from atlas_lightning.rollout import factory

    seen = {}

    def build_engine(cfg, rank=0, local_rank=0, world_size=1, actor_lora=None):
        seen["actor_lora"] = actor_lora
        raise _Built

    monkeypatch.setattr(factory, "build_engine", build_engine)
    return seen


SHAPE = LoraShape(rank=3, alpha=6, target_modules=("q_proj",), source="the run's start-up")


def test_the_memory_checks_colocated_engine_gets_the_runs_actor_shape(tiny_model_dir, tmp_path, built):
    from atlas_lightning.run.memory_check import MemoryCheckModule

    module = MemoryCheckModule(_cfg(tiny_model_dir, tmp_path), actor_lora=SHAPE)
    module._trainer = SimpleNamespace(world_size=1, global_rank=0, local_rank=0)
    with pytest.raises(_Built):
        module._measure_generation()
    assert built["actor_lora"] is SHAPE


def test_the_memory_checks_server_gets_the_runs_actor_shape(tiny_model_dir, tmp_path, built):
    from atlas_lightning.run.memory_check_separate import ServingSide

    side = ServingSide(_cfg(tiny_model_dir, tmp_path, "layout=separate_cpu"), actor_lora=SHAPE)
    with pytest.raises(_Built):
        side.start(SimpleNamespace(global_rank=0, local_rank=0, world_size=1), None)
    assert built["actor_lora"] is SHAPE


def test_run_memory_check_hands_the_resolved_shapes_to_its_module(tiny_model_dir, tmp_path, monkeypatch):
    from atlas_lightning.run import memory_check, wiring

    seen = {}

    class Trainer:
        def fit(self, module, datamodule):
            seen["actor_lora"] = module.actor_lora
            raise _Built

    monkeypatch.setattr(wiring, "build_trainer", lambda *a, **k: Trainer())
    with pytest.raises(_Built):
        memory_check.run_memory_check(_cfg(tiny_model_dir, tmp_path), vocab_size=64,
                                      lora={"actor": SHAPE, "critic": SHAPE})
    assert seen["actor_lora"] is SHAPE
