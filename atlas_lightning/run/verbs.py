"""What each config verb does, once its config has composed and validated (``cli.py``).

``fit`` verifies and reads what the run starts from once (``run/facts.py``: folders, LoRA
shapes, question splits, the checkpoint to resume), then builds the Lightning pieces from the
config and those facts: the ``RolloutDataModule`` (the loaded questions, engines, rollouts), the
``PPOModule`` (the PPO step, its weight sync included), the strategy (one device, or FSDP2
through ``ModelParallelStrategy``), the loggers and the configured callbacks (checkpoints last),
then runs ``Trainer.fit``; a fault part-way stops it cleanly (``run/faults.py``).
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from atlas_lightning import distributed as dist_utils
from atlas_lightning.run.facts import RunFacts, check_inputs
from atlas_lightning.run.faults import stops_cleanly
from atlas_lightning.run.user_code import user_code
from atlas_lightning.run.wiring import RUN_LOG, build_callbacks, build_trainer, prepare_run

log = logging.getLogger("atlas_lightning")


def fit(cfg: DictConfig) -> int:
    from atlas_lightning.rollout.datamodule import RolloutDataModule
    from atlas_lightning.ppo.module import PPOModule
    from atlas_lightning.run.recompute import CheckpointLayersFor

    if cfg.trainer.memory_check:  # the report's memory-check runs: synthetic steps, no rollouts
        return memory_check(cfg)
    facts = check_inputs(cfg)  # before anything is written: a bad model folder or checkpoint exits 2
    callbacks = build_callbacks(cfg, facts)  # a bad callback argument too
    # and a reward or weight sync that cannot be built; model.checkpoint_layers=auto resolved on the card
    module = PPOModule(cfg, resume_from=facts.start.resume, checkpoint_layers_for=CheckpointLayersFor(cfg))
    datamodule = RolloutDataModule(cfg, questions=facts.questions, resume_from=facts.start.resume,
                                   actor_lora=facts.lora["actor"])
    with stops_cleanly(facts.folders["checkpoints"], last_step=lambda: _step_of(str(facts.start.resume or ""))):
        prepare_run(cfg, "fit", notes=facts.notes)  # a disk full already: the write stop (exit 7)
    trainer = build_trainer(cfg, callbacks=callbacks)
    started = time.time()
    # a fault part-way (engine, memory, non-finite) stops cleanly, naming the checkpoint to resume from
    with stops_cleanly(facts.folders["checkpoints"], last_step=lambda: module.finished_step, trainer=trainer,
                       user=user_code(cfg)):
        trainer.fit(module, datamodule=datamodule, ckpt_path=facts.start.state)
    if trainer.global_rank == 0:
        _closing_summary(cfg, facts, time.time() - started)
    dist_utils.shut_down()
    return 0


def _closing_summary(cfg: DictConfig, facts: RunFacts, seconds: float) -> None:
    from atlas_lightning.store.checkpoints import latest_complete
    from atlas_lightning.store.learning_curve import learning_line

    dirs, shapes = facts.folders, facts.lora
    latest = latest_complete(dirs["checkpoints"])
    lines = [
        f"atlas-lightning fit {cfg.name}: done in {seconds / 60:.1f} min",
        f"  model        {cfg.model.path} (LoRA actor {shapes['actor'].describe()}; "
        f"critic {shapes['critic'].describe()})",
        f"  config       {dirs['outputs'] / 'config.yaml'}",
        f"  log          {dirs['outputs'] / RUN_LOG}",
        f"  artifacts    {dirs['artifacts']}",
        f"  checkpoints  {latest if latest else dirs['checkpoints']}",
        f"  W&B export   {dirs['runs']}",
    ]
    figures = dirs["artifacts"] / "val_figures"
    if figures.is_dir():
        lines.append(f"  figures      {figures}")
    learned = learning_line(dirs["artifacts"])
    if learned:
        lines.append(f"  learning     {learned}")
    print("\n".join(lines), file=sys.stderr)
    log.info("closing summary:\n%s", "\n".join(lines))


def _step_of(path: Optional[str]) -> int:
    """N of a ``.../global_step_N[/...]`` path, else 0."""
    from atlas_lightning.store.checkpoints import checkpoint_step

    steps = (checkpoint_step(part) for part in reversed(Path(path).parts if path else ()))
    return next((step for step in steps if step is not None), 0)


def validate(cfg: DictConfig) -> int:
    """The validation sets through the agent loop with the configured weights: a run's
    checkpoint (``trainer.resume``), another run's step (``trainer.init_from``) or explicit
    adapters (``model.actor_adapter``), else the fresh adapters. Metrics, the dump
    ``val_dumps/N.jsonl`` and records are written as in training, N being the step validated."""
    import lightning as L

    from atlas_lightning.callbacks.validation import ValidationCallback
    from atlas_lightning.rollout.datamodule import RolloutDataModule
    from atlas_lightning.ppo.module import PPOModule

    facts = check_inputs(cfg, training=False)  # it validates weights: nothing in flight is continued
    ckpt = facts.start.state
    step = _step_of(ckpt or cfg.trainer.init_from or cfg.model.actor_adapter)
    results: dict = {}

    class _ValidateOnce(L.Callback):
        def on_validation_start(self, trainer, pl_module):
            pl_module.rl_step = step
            pl_module.sync_weights(step)  # the weights to validate reach the engine before its rollout
            validation = ValidationCallback(val_every=1, artifacts=facts.folders["artifacts"],
                                            checkpoints=facts.folders["checkpoints"], run_id=cfg.name)
            results.update(validation.run_validation(trainer, pl_module, step))

    # built before anything is written: a reward or weight sync that cannot be built exits 2
    module = PPOModule(cfg, resume_from=facts.start.resume)
    datamodule = RolloutDataModule(cfg, questions=facts.questions, actor_lora=facts.lora["actor"])
    # a fault (the engine dies, the disk is full) stops cleanly as in fit
    with stops_cleanly(facts.folders["checkpoints"], last_step=lambda: step):
        prepare_run(cfg, "validate", notes=facts.notes)
        trainer = build_trainer(cfg, callbacks=[_ValidateOnce()], limit_val_batches=1)
        trainer.validate(module, datamodule=datamodule, ckpt_path=ckpt)
    if trainer.global_rank == 0:
        shown = {k: v for k, v in sorted(results.items()) if k.endswith(("/acc", "/objective"))}
        print("\n".join(f"{k:40s} {v:.4f}" for k, v in shown.items()), file=sys.stderr)
    dist_utils.shut_down()
    return 0


def memory_check(cfg: DictConfig) -> int:
    """Synthetic steps at the full token budget; each card's peak per phase (``memory_check.py``)."""
    from atlas_lightning.run.memory_check import main_verb

    return main_verb(cfg)


def plan(cfg: DictConfig) -> int:
    """Per-card memory of each phase, refusals before launch (``planning``); exit 2 when refused.
    The card's memory is ``plan.card_gib`` (default 80)."""
    from atlas_lightning.planning.cli import run_plan

    return run_plan(cfg)


def publish(cfg: DictConfig, weights: bool = False) -> int:
    """The data root ``paths.root`` to the Hub (``hub/publish.py``), once what it needs here is
    checked (``check_publish``)."""
    from atlas_lightning.hub.publish import publish_from_config

    check_publish(cfg)
    return publish_from_config(cfg, weights)


def check_publish(cfg: DictConfig) -> None:
    """Before the Hub is asked anything: ``hub.repo_id``, then ``paths.root`` is a folder holding a run's folders
    (``hub.publish.TOP_LEVEL_FOLDERS``) and can take the ``README.md`` and ``FILES.txt`` written
    there, and the Hub is not switched off (``HF_HUB_OFFLINE``: ``run/environment.check_hub_online``).
    ``ConfigError`` naming the key or variable otherwise."""
    from atlas_lightning.config import ConfigError
    from atlas_lightning.hub.publish import TOP_LEVEL_FOLDERS, check_hub_repo
    from atlas_lightning.run.environment import check_hub_online, check_hub_token
    from atlas_lightning.run.facts import check_writable

    check_hub_repo(cfg)  # the keys first, then what they name
    root = Path(cfg.paths.root)
    if not root.is_dir():
        raise ConfigError(f"paths.root={root}: {'not a folder' if root.exists() else 'no such folder'} (publish "
                          f"sends a data root: the paths.root a fit wrote)")
    if not any((root / name).is_dir() for name in TOP_LEVEL_FOLDERS):
        raise ConfigError(f"paths.root={root}: nothing to publish (none of {', '.join(TOP_LEVEL_FOLDERS)} there: "
                          f"the paths.root a fit wrote)")
    check_writable({"root": root})
    check_hub_online("publish")
    check_hub_token("publish", "or publish where one is")
