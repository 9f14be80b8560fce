"""The run wiring: from a validated config to the Lightning pieces every verb runs on.

``prepare_run`` (folders, the resolved config, the logs), ``build_strategy`` (one device, or
FSDP2 through ``ModelParallelStrategy`` over every training process), ``build_loggers``,
``build_callbacks`` (every callback comes from ``conf/callbacks/``, by ``_target_``),
``resume_path`` (``trainer.resume``) and ``build_trainer``.

Who calls it: ``run/verbs.py`` (fit, validate), ``run/memory_check.py`` (its own synthetic
trainer shares the strategy and folders), tests.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from atlas_lightning.config import ConfigError, run_dirs
from atlas_lightning.loggers.wandb_logger import build_loggers
from atlas_lightning.store.atomic import atomic_write_text

log = logging.getLogger("atlas_lightning")


def _launch_rank() -> int:
    """This process's global rank before Lightning has set anything up (torchrun/SLURM/Lightning env)."""
    for key in ("RANK", "SLURM_PROCID"):
        if key in os.environ:
            return int(os.environ[key])
    node = int(os.environ.get("NODE_RANK", "0"))
    return int(os.environ.get("LOCAL_RANK", "0")) if node == 0 else 1


def prepare_run(cfg: DictConfig, verb: str) -> dict[str, Path]:
    """Folders of seed section 2, the resolved config (``outputs/<name>/config.yaml``) and the
    logs (``outputs/<name>/main.log`` across launches, ``logs/<name>-<time>-<verb>.log`` for this
    launch). Rank 0 writes; other ranks only get the paths."""
    dirs = run_dirs(cfg)
    if _launch_rank() != 0:
        return dirs
    for key in ("outputs", "logs"):
        dirs[key].mkdir(parents=True, exist_ok=True)
    atomic_write_text(dirs["outputs"] / "config.yaml", OmegaConf.to_yaml(cfg))
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    for path in (dirs["outputs"] / "main.log", dirs["logs"] / f"{cfg.name}-{stamp}-{verb}.log"):
        handler = logging.FileHandler(path)
        handler.setFormatter(formatter)
        for name in ("atlas_lightning", "lightning", "lightning.pytorch"):
            logging.getLogger(name).addHandler(handler)
    logging.getLogger("atlas_lightning").setLevel(logging.INFO)
    log.info("%s %s: config saved to %s", verb, cfg.name, dirs["outputs"] / "config.yaml")
    return dirs


def build_callbacks(cfg: DictConfig) -> list:
    """Every callback of ``cfg.callbacks`` (``conf/callbacks/default.yaml``), in its order; a
    null entry is skipped. The weight sync is listed first (validation after step N must
    sample the step-N weights); Lightning runs the step checkpoint (a ``Checkpoint``) last."""
    from hydra.utils import instantiate
    from lightning.pytorch.callbacks import Checkpoint

    callbacks = []
    for name, spec in (cfg.callbacks or {}).items():
        if spec is None:
            continue
        try:
            callbacks.append(instantiate(spec))
        except Exception as err:  # a bad class path or argument, named for the user
            raise ConfigError(f"callbacks.{name}: cannot build {spec.get('_target_')}: {err}") from err
    # as Lightning orders them: checkpoints after every other callback
    return sorted(callbacks, key=lambda callback: isinstance(callback, Checkpoint))


def trains_on_gpu(accelerator: str) -> bool:
    """Whether ``trainer.accelerator`` puts training on GPUs (``auto``: when CUDA is present)."""
    import torch

    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def build_strategy(cfg: DictConfig):
    """FSDP2 (``ModelParallelStrategy``, NCCL on GPUs) over every training process, also for one
    GPU: the 8-card runs' strategy, process group and checkpoint format at world 1, and the
    process group a colocated engine joins (``external_launcher``). A single CPU process keeps
    Lightning's ``auto`` (no process group; CPU tests and the embedded default). The strategy
    resumes from the trainable-only checkpoints the module saves (``run/strategy.py``)."""
    world = cfg.trainer.devices * cfg.trainer.num_nodes
    if world == 1 and not trains_on_gpu(cfg.trainer.accelerator):
        return "auto"
    from atlas_lightning.run.strategy import TrainableStateStrategy

    return TrainableStateStrategy(data_parallel_size=world, tensor_parallel_size=1)


def resume_path(cfg: DictConfig) -> Optional[str]:
    """``trainer.resume``: None, ``auto`` (this run's newest complete checkpoint, if any) or a
    ``global_step_N`` folder, which must be complete."""
    from atlas_lightning.store.checkpoints import is_complete, latest_complete, lightning_state_path

    resume = cfg.trainer.resume
    if not resume:
        return None
    if resume == "auto":
        folder = latest_complete(run_dirs(cfg)["checkpoints"])
        return str(lightning_state_path(folder)) if folder else None
    folder = Path(resume)
    if not is_complete(folder):
        raise ConfigError(f"trainer.resume={resume}: not a complete checkpoint folder (no checkpoint.json)")
    return str(lightning_state_path(folder))


def build_trainer(cfg: DictConfig, callbacks: Optional[list] = None, loggers: Optional[list] = None,
                  limit_val_batches: int = 0):
    import lightning as L

    t = cfg.trainer
    return L.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=build_strategy(cfg),
        precision=t.precision,
        max_epochs=1,
        logger=loggers if loggers is not None else build_loggers(cfg),
        callbacks=callbacks if callbacks is not None else build_callbacks(cfg),
        num_sanity_val_steps=0,
        limit_val_batches=limit_val_batches,
        log_every_n_steps=1,
        default_root_dir=str(run_dirs(cfg)["outputs"]),
        enable_model_summary=False,
    )
