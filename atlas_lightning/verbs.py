"""What each config verb does, once its config has composed and validated (``cli.py``).

``fit`` builds the Lightning pieces from the config: the ``RolloutDataModule`` (questions,
engines, rollouts), the ``PPOModule`` (the PPO step), the strategy (one device, or FSDP2
through ``ModelParallelStrategy``), the loggers and the callbacks (weight sync first, the
configured ones, checkpoints last), then runs ``Trainer.fit``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from atlas_lightning import distributed as dist_utils
from atlas_lightning.atomic import atomic_write_text
from atlas_lightning.config import ConfigError, run_dirs

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
    """Weight sync first (validation after step N must sample the step-N weights), then the
    configured callbacks in order, then the step checkpoint (Lightning runs it last)."""
    from hydra.utils import instantiate

    from atlas_lightning.callbacks.checkpoint import StepCheckpoint
    from atlas_lightning.callbacks.weight_sync import WeightSyncCallback

    callbacks = [WeightSyncCallback()]
    for name, spec in (cfg.callbacks or {}).items():
        if spec is None:
            continue
        try:
            callbacks.append(instantiate(spec))
        except Exception as err:  # a bad class path or argument, named for the user
            raise ConfigError(f"callbacks.{name}: cannot build {spec.get('_target_')}: {err}") from err
    from atlas_lightning.callbacks.hub import hub_callback_from_config

    hub = hub_callback_from_config(cfg)
    if hub is not None:
        callbacks.append(hub)
    callbacks.append(StepCheckpoint(every_n_steps=cfg.trainer.save_every))
    return callbacks


def build_loggers(cfg: DictConfig) -> list:
    from atlas_lightning.loggers import build_loggers as build

    return build(cfg)


def build_strategy(cfg: DictConfig):
    world = cfg.trainer.devices * cfg.trainer.num_nodes
    if world == 1:
        return "auto"
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)


def resume_path(cfg: DictConfig) -> Optional[str]:
    """``trainer.resume``: None, ``auto`` (this run's newest complete checkpoint, if any) or a
    ``global_step_N`` folder, which must be complete."""
    from atlas_lightning.callbacks.checkpoint import is_complete, latest_complete, lightning_state_path

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


def fit(cfg: DictConfig) -> int:
    from atlas_lightning.data.datamodule import RolloutDataModule
    from atlas_lightning.module import PPOModule

    if cfg.trainer.memory_check:  # the report's memory-check runs: synthetic steps, no rollouts
        return memory_check(cfg)
    dirs = prepare_run(cfg, "fit")
    ckpt = resume_path(cfg)
    trainer = build_trainer(cfg)
    module = PPOModule(cfg)
    datamodule = RolloutDataModule(cfg)
    started = time.time()
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt)
    if trainer.global_rank == 0:
        _closing_summary(cfg, dirs, time.time() - started)
    dist_utils.shut_down()
    return 0


def _closing_summary(cfg: DictConfig, dirs: dict[str, Path], seconds: float) -> None:
    from atlas_lightning.callbacks.checkpoint import latest_complete

    latest = latest_complete(dirs["checkpoints"])
    lines = [
        f"atlas-lightning fit {cfg.name}: done in {seconds / 60:.1f} min",
        f"  model        {cfg.model.path} (LoRA r{cfg.model.lora.rank}, actor + critic)",
        f"  config       {dirs['outputs'] / 'config.yaml'}",
        f"  log          {dirs['outputs'] / 'main.log'}",
        f"  artifacts    {dirs['artifacts']}",
        f"  checkpoints  {latest if latest else dirs['checkpoints']}",
        f"  W&B export   {dirs['runs']}",
    ]
    figures = dirs["artifacts"] / "val_figures"
    if figures.is_dir():
        lines.append(f"  figures      {figures}")
    print("\n".join(lines), file=sys.stderr)


def _step_of(path: Optional[str]) -> int:
    """N of a ``.../global_step_N[/...]`` path, else 0."""
    for part in reversed(Path(path).parts if path else ()):
        if part.startswith("global_step_") and part[len("global_step_"):].isdigit():
            return int(part[len("global_step_"):])
    return 0


def validate(cfg: DictConfig) -> int:
    """The validation sets through the agent loop with the configured weights: a run's
    checkpoint (``trainer.resume``), another run's step (``trainer.init_from``) or explicit
    adapters (``model.actor_adapter``), else the fresh adapters. Metrics, the dump
    ``val_dumps/N.jsonl`` and records are written as in training, N being the step validated."""
    import lightning as L

    from atlas_lightning.callbacks.validation import ValidationCallback
    from atlas_lightning.callbacks.weight_sync import WeightSyncCallback
    from atlas_lightning.data.datamodule import RolloutDataModule
    from atlas_lightning.module import PPOModule

    prepare_run(cfg, "validate")
    ckpt = resume_path(cfg)
    step = _step_of(ckpt or cfg.trainer.init_from or cfg.model.actor_adapter)
    results: dict = {}

    class _ValidateOnce(L.Callback):
        def on_validation_start(self, trainer, pl_module):
            pl_module.rl_step = step
            WeightSyncCallback().sync(trainer, pl_module, version=step)
            results.update(ValidationCallback(val_every=1).run_validation(trainer, pl_module, step))

    trainer = build_trainer(cfg, callbacks=[_ValidateOnce()], limit_val_batches=1)
    trainer.validate(PPOModule(cfg), datamodule=RolloutDataModule(cfg), ckpt_path=ckpt)
    if trainer.global_rank == 0:
        shown = {k: v for k, v in sorted(results.items()) if k.endswith(("/acc", "/objective"))}
        print("\n".join(f"{k:40s} {v:.4f}" for k, v in shown.items()), file=sys.stderr)
    dist_utils.shut_down()
    return 0


def memory_check(cfg: DictConfig) -> int:
    """Synthetic steps at the full token budget; each card's peak per phase (``memory_check.py``)."""
    from atlas_lightning.memory_check import main_verb

    return main_verb(cfg)


def plan(cfg: DictConfig) -> int:
    """Per-card memory of each phase, refusals before launch (``planning``); exit 2 when refused.
    The card's memory comes from ``ATLAS_CARD_GIB`` (default 80)."""
    from atlas_lightning.planning.cli import run_plan

    return run_plan(cfg)


def publish(cfg: DictConfig, weights: bool = False) -> int:
    from atlas_lightning.publish import publish_from_config

    return publish_from_config(cfg, weights)
