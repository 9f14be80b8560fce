"""The strategy of a run: FSDP2 (``ModelParallelStrategy``) wherever training is on GPUs, one GPU
included, so that one card runs what eight do (the process group the colocated engine joins,
the torch.distributed checkpoint format); a single CPU process keeps Lightning's ``auto``."""

from __future__ import annotations

import pytest
from lightning.pytorch.strategies import ModelParallelStrategy

from atlas_lightning.config import compose
from atlas_lightning.run.environment import trains_on_gpu
from atlas_lightning.run.wiring import build_strategy


@pytest.mark.parametrize("experiment", ["h200-tiny", "h200-8b", "r28-continued-cost-8gpu-n32"])
def test_gpu_runs_take_fsdp2_at_any_world_size(experiment, tmp_path):
    cfg = compose([f"experiment={experiment}", f"paths.root={tmp_path}"])
    strategy = build_strategy(cfg)
    assert isinstance(strategy, ModelParallelStrategy)
    world = cfg.trainer.devices * cfg.trainer.num_nodes
    assert strategy._data_parallel_size == world and strategy._tensor_parallel_size == 1


def test_one_cpu_process_keeps_auto_and_several_take_fsdp2(tmp_path):
    assert build_strategy(compose(["experiment=tiny-cpu", f"paths.root={tmp_path}"])) == "auto"
    two = compose(["experiment=tiny-cpu", f"paths.root={tmp_path}", "trainer.devices=2", "layout.gpus=2",
                   "layout.train_gpus=2"])
    assert isinstance(build_strategy(two), ModelParallelStrategy)


def test_auto_accelerator_follows_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert trains_on_gpu("auto") and trains_on_gpu("gpu") and not trains_on_gpu("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not trains_on_gpu("auto") and trains_on_gpu("cuda")
