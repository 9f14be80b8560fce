"""The run wiring: from a validated config to the Lightning pieces every verb runs on.

``check_inputs`` (what the run starts from, verified before anything is written: the model
folder, ``trainer.init_from``, ``trainer.resume``), ``prepare_run`` (folders, the resolved
config, the logs), ``build_strategy`` (one device, or FSDP2 through ``ModelParallelStrategy``
over every training process), ``build_loggers``, ``build_callbacks`` (every callback comes
from ``conf/callbacks/``, by ``_target_``), ``resume_path`` (``trainer.resume``) and
``build_trainer``.

Who calls it: ``run/verbs.py`` (fit, validate), ``run/memory_check.py`` (its synthetic steps
run on ``build_trainer``'s trainer: same strategy, precision and folders as ``fit``), tests.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from atlas_lightning.config import ConfigError, redacted, run_dirs
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


#: The run's log under ``outputs/<name>/`` (README, "On-disk layout"), appended to by every launch.
RUN_LOG = "main_ppo.log"


def prepare_run(cfg: DictConfig, verb: str) -> dict[str, Path]:
    """Folders of README, "On-disk layout", the resolved config (``outputs/<name>/config.yaml``) and the
    logs (``outputs/<name>/main_ppo.log``, the name the runs of ATLAS report 28, the reproduced report, wrote, across launches;
    ``logs/<name>-<time>-<verb>.log`` for this launch). Rank 0 writes; other ranks only get the paths."""
    dirs = run_dirs(cfg)
    if _launch_rank() != 0:
        return dirs
    for key in ("outputs", "logs"):
        dirs[key].mkdir(parents=True, exist_ok=True)
    atomic_write_text(dirs["outputs"] / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(redacted(cfg))))
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    for path in (dirs["outputs"] / RUN_LOG, dirs["logs"] / f"{cfg.name}-{stamp}-{verb}.log"):
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


@dataclass
class StartingPoint:
    """What a run starts from, verified (``check_inputs``)."""

    #: The ``global_step_N`` folder ``trainer.resume`` resolved to (None: a fresh run).
    resume: Optional[Path] = None
    #: What ``trainer.fit(ckpt_path=...)`` takes for it.
    state: Optional[str] = None
    #: What was decided on the way (e.g. newer checkpoints that did not verify), for the run's log.
    notes: list[str] = field(default_factory=list)


def check_inputs(cfg: DictConfig, *, data: bool = True) -> StartingPoint:
    """Verify what the run reads before anything is written (every verb that loads the model
    calls it first): ``paths.root`` (a folder, or creatable), ``model.path``
    (``planning.model_folder``), the question splits (``data``: every file of the train and
    validation splits loads, ``questions.loader``), ``trainer.init_from`` (a complete checkpoint
    whose adapters verify against ``checkpoint.json``) and ``trainer.resume`` (``resume_path``).
    ``ConfigError`` / ``DataError`` naming the key or file otherwise (the CLI exits 2)."""
    from atlas_lightning.planning.model_folder import check_model_folder
    from atlas_lightning.store.checkpoints import CheckpointError, verify_checkpoint

    from atlas_lightning.run.environment import check_machine

    _check_writable(run_dirs(cfg))
    check_machine(cfg)
    check_model_folder(cfg.model.path)
    _check_lora_targets(cfg.model)
    if data:
        from atlas_lightning.questions.loader import load_split

        for split in (cfg.data.train_split, cfg.data.val_split):
            load_split(cfg.data, split)
    if cfg.trainer.init_from:
        parts = ("actor", "critic") if cfg.trainer.init_critic else ("actor",)
        try:
            verify_checkpoint(Path(cfg.trainer.init_from), parts=parts)
        except CheckpointError as err:
            raise ConfigError(f"trainer.init_from={cfg.trainer.init_from}: {err}") from None
    for role in ("actor", "critic"):
        folder = cfg.model.get(f"{role}_adapter")
        if folder and not Path(folder).is_dir():
            raise ConfigError(f"model.{role}_adapter={folder}: no such folder")
    return resume_path(cfg)


def _check_lora_targets(model_cfg) -> None:
    """``model.lora.target_modules`` (and ``model.critic_lora``'s) each name a module of the base
    (peft would fail on none matching only after the engine started, and skip a typo silently
    when another target matches)."""
    from atlas_lightning.planning.model_folder import linear_module_names, unmatched_lora_targets

    modules = None
    for key in ("lora", "critic_lora"):
        targets = model_cfg[key].target_modules
        if targets is None or targets == "all-linear":
            continue
        modules = linear_module_names(model_cfg.path) if modules is None else modules
        unmatched = unmatched_lora_targets(list(targets), modules)
        if unmatched:
            leaves = sorted({name.rsplit(".", 1)[-1] for name in modules})
            raise ConfigError(f"model.{key}.target_modules: {', '.join(unmatched)} names no module of the base "
                              f"{model_cfg.path} (its linear modules end in: {', '.join(leaves[:20])})")


def _check_writable(dirs: dict[str, Path]) -> None:
    """Every folder the run writes (``run_dirs``: root, outputs, logs, checkpoints, artifacts,
    runs, wandb) is a folder, or the nearest existing folder above it is, and a file can be made
    there. Tried with an unnamed temporary file rather than ``os.access``, which says yes to root
    on a read-only mount, an immutable folder or ``/proc``."""
    import tempfile

    for key, folder in dirs.items():
        existing = folder
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        where = f"paths.root={folder}" if key == "root" else f"the run's {key} folder {folder}"
        if not existing.is_dir():
            raise ConfigError(f"{where}: {existing} is not a folder")
        try:
            with tempfile.TemporaryFile(dir=existing):
                pass
        except OSError as err:
            raise ConfigError(f"{where}: {existing} is not writable ({err.strerror or err}); "
                              f"choose another paths.root or fix the folder's permissions") from None


def resume_path(cfg: DictConfig) -> StartingPoint:
    """``trainer.resume``: None (fresh), ``auto`` (this run's newest checkpoint that verifies;
    newer ones that do not are named in ``notes``; if checkpoints exist and none verifies it is
    refused rather than started afresh over them) or a ``global_step_N`` folder, which must
    verify (``store.checkpoints.verify_checkpoint``: marker, file list, sizes, sha256)."""
    from atlas_lightning.store.checkpoints import (
        CheckpointError, latest_verified, lightning_state_path, verify_checkpoint,
    )

    resume = cfg.trainer.resume
    if not resume:
        return StartingPoint()
    if resume == "auto":
        folder, refusals = latest_verified(run_dirs(cfg)["checkpoints"])
        notes = [f"trainer.resume=auto: skipped {reason}" for reason in refusals]
        if folder is None and refusals:
            raise ConfigError("trainer.resume=auto: no checkpoint of this run verifies:\n  " + "\n  ".join(refusals)
                              + "\nmove the damaged folders away, or set trainer.resume=null to start afresh")
        if folder is not None:
            _check_state(folder, "trainer.resume=auto")
            notes.append(f"trainer.resume=auto: resuming from {folder} (verified)")
        return StartingPoint(folder, str(lightning_state_path(folder)) if folder else None, notes)
    folder = Path(resume)
    if not folder.exists():
        raise ConfigError(f"trainer.resume={resume}: no such folder (a global_step_N folder of a run, or auto)")
    try:
        verify_checkpoint(folder)
    except CheckpointError as err:
        raise ConfigError(f"trainer.resume={resume}: {err}") from None
    _check_state(folder, f"trainer.resume={resume}")
    return StartingPoint(folder, str(lightning_state_path(folder)), [f"trainer.resume: resuming from {folder} (verified)"])


def _check_state(folder: Path, key: str) -> None:
    """The checkpoint's Lightning state is whole (``run/resume_state.py``), or the key is refused."""
    from atlas_lightning.run.resume_state import ResumeStateError, check_resume_state

    try:
        check_resume_state(folder)
    except ResumeStateError as err:
        raise ConfigError(f"{key}: {err}") from None


def build_trainer(cfg: DictConfig, callbacks: Optional[list] = None, loggers: Optional[list] = None,
                  limit_val_batches: int = 0, *, progress_bar: bool = True, checkpointing: bool = True):
    """The ``lightning.Trainer`` every verb runs on: ``cfg.trainer``'s devices and precision,
    ``build_strategy``, one epoch, no sanity validation, ``outputs/<name>/`` as its root. ``callbacks`` and ``loggers`` default to the
    configured ones (``build_callbacks``, ``build_loggers``; ``[]`` for none);
    ``limit_val_batches`` is 0 for ``fit`` (validation is a callback) and 1 for ``validate``;
    ``progress_bar=False`` and ``checkpointing=False`` (no Lightning ``ModelCheckpoint`` added
    in place of the step checkpoint) for the memory check, which saves nothing but its report."""
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
        enable_progress_bar=progress_bar,
        enable_checkpointing=checkpointing,
    )
