"""Which Lightning strategy a run trains under, decided from its config alone: ``build_strategy``.

Kept apart from ``run/wiring.py`` (which builds the trainer with it) so that the start-up checks
(``run/facts.py``: the checkpoint format a resume must match) read the same rule without
importing the wiring, nor Lightning for a single CPU process.
"""

from __future__ import annotations

from omegaconf import DictConfig


def build_strategy(cfg: DictConfig):
    """FSDP2 (``ModelParallelStrategy``, NCCL on GPUs) over every training process, also for one
    GPU: the 8-card runs' strategy, process group and checkpoint format at world 1, and the
    process group a colocated engine joins (``external_launcher``). A single CPU process keeps
    Lightning's ``auto`` (no process group; CPU tests and the embedded default). The strategy
    resumes from the trainable-only checkpoints the module saves (``run/strategy.py``)."""
    from atlas_lightning.run.environment import trains_on_gpu

    world = cfg.trainer.devices * cfg.trainer.num_nodes
    if world == 1 and not trains_on_gpu(cfg.trainer.accelerator):
        return "auto"
    from atlas_lightning.run.strategy import TrainableStateStrategy

    return TrainableStateStrategy(data_parallel_size=world, tensor_parallel_size=1)
