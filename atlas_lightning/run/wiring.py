"""The run wiring: from a validated config and the run's facts to the Lightning pieces every verb runs on.

``prepare_run`` (folders, the resolved config, the logs), ``build_strategy`` (one device, or
FSDP2 through ``ModelParallelStrategy`` over every training process: ``run/strategy_choice.py``), ``build_loggers``,
``build_callbacks`` (every callback comes from ``conf/callbacks/``, by ``_target_``, its
settings interpolated there) and ``build_trainer``. What the run starts from is verified before
any of it, once: ``run/facts.py``.

Who calls it: ``run/verbs.py`` (fit, validate), ``run/memory_check.py`` (its synthetic steps
run on ``build_trainer``'s trainer: same strategy, precision and folders as ``fit``), tests.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from atlas_lightning.config import ConfigError, redacted, redacted_text
from atlas_lightning.loggers.wandb_logger import build_loggers
from atlas_lightning.run.strategy_choice import build_strategy
from atlas_lightning.store.atomic import atomic_write_text

if TYPE_CHECKING:
    from atlas_lightning.run.facts import RunFacts

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


class RunLogHandler(logging.FileHandler):
    """One of the run's log files (``prepare_run``). A write the file system refuses (the disk
    full, a quota, a file system gone read-only: an ``OSError``, in a line's write, a flush or
    the close at exit) is counted (``lost``), the first refusal kept (``failure``) and said once
    on stderr, in one line, instead of logging's "--- Logging error ---" and a traceback for
    every line: the run goes on, and a disk that stays full stops it at its next checkpoint or
    record with the write stop (exit 7, ``run/faults.py``), whose line the CLI prints. Any other
    error (a log call whose arguments do not fit its format: a bug) is reported as logging does."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.failure: Optional[OSError] = None
        self.lost = 0

    def handleError(self, record: logging.LogRecord) -> None:
        err = sys.exc_info()[1]
        if isinstance(err, OSError):
            self._refused(err)
        else:
            super().handleError(record)

    def flush(self) -> None:
        try:
            super().flush()
        except OSError as err:
            self._refused(err)

    def close(self) -> None:
        try:
            super().close()
        except OSError as err:  # the file's last buffered lines refused
            self._refused(err)

    def _refused(self, err: OSError) -> None:
        self.lost += 1
        if self.failure is None:
            self.failure = err
            try:
                sys.stderr.write(f"atlas-lightning: the run's log {self.baseFilename} cannot be written "
                                 f"({err.strerror or err}): its lines from here on may be lost\n")
            except (OSError, ValueError):  # stderr closed or refused too: nowhere left to say it
                pass


class RedactingFormatter(logging.Formatter):
    """The run logs' lines with every credential masked (``config.redacted_text``: a URL's
    password, a bearer or Hub token, a credential of the environment), whichever library logged it."""

    def format(self, record: logging.LogRecord) -> str:
        return redacted_text(super().format(record))


def _check_run_files(outputs: Path) -> None:
    """The files every launch writes at the same place (``outputs/<name>/config.yaml``, replaced;
    ``main_ppo.log``, appended to): where one exists it is a file, or a link to one (a folder of
    that name would fail the launch half-way through its first writes, with a traceback), and
    ``main_ppo.log`` takes lines."""
    for path in (outputs / "config.yaml", outputs / RUN_LOG):
        if path.exists() and path.is_dir():
            raise ConfigError(f"the run's file {path} is a folder: move it away (each launch writes its "
                              f"{path.name} there)")
        if path.exists() and not path.is_file() and not path.is_char_device():
            raise ConfigError(f"the run's file {path} is not a file: move it away (each launch writes its "
                              f"{path.name} there)")
    log_file = outputs / RUN_LOG
    if log_file.exists():
        try:  # appended to, not replaced: the file itself must take lines (opening changes no byte)
            with open(log_file, "ab"):
                pass
        except OSError as err:
            raise ConfigError(f"the run's log {log_file} cannot be appended to ({err.strerror or err}): fix its "
                              f"permissions or move it away (each launch appends its lines)") from None


def prepare_run(cfg: DictConfig, verb: str, notes: Sequence[str] = ()) -> None:
    """The folders ``paths.outputs`` and ``paths.logs`` (README, "On-disk layout"), the resolved
    config (``outputs/<name>/config.yaml``) and the logs (``outputs/<name>/main_ppo.log``, the
    name the runs of ATLAS report 28, the reproduced report, wrote, across launches;
    ``logs/<name>-<time>-<verb>.log`` for this launch), once neither of the first two is a folder
    (``ConfigError``, nothing written); ``notes`` (what was decided at
    start-up, ``RunFacts.notes``) go to the logs and stderr. Rank 0 writes; other
    ranks do nothing."""
    if _launch_rank() != 0:
        return
    outputs, logs = Path(cfg.paths.outputs), Path(cfg.paths.logs)
    _check_run_files(outputs)  # before the first write
    for folder in (outputs, logs):
        folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(outputs / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(redacted(cfg))))
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    formatter = RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    for path in (outputs / RUN_LOG, logs / f"{cfg.name}-{stamp}-{verb}.log"):
        handler = RunLogHandler(path)
        handler.setFormatter(formatter)
        for name in ("atlas_lightning", "lightning", "lightning.pytorch"):
            logging.getLogger(name).addHandler(handler)
    logging.getLogger("atlas_lightning").setLevel(logging.INFO)
    log.info("%s %s: config saved to %s", verb, cfg.name, outputs / "config.yaml")
    for note in notes:
        log.warning(note)
        print(f"atlas-lightning {verb}: {note}", file=sys.stderr)


def build_callbacks(cfg: DictConfig, facts: Optional["RunFacts"] = None) -> list:
    """Every callback of ``cfg.callbacks`` (``conf/callbacks/default.yaml``), in its order, built
    from its entry (its settings and folders are interpolated there; each argument checked
    against what its class takes first, ``run/callback_arguments.py``); a null entry is skipped.
    Building writes nothing: verbs build the callbacks before ``prepare_run``, so that a bad
    argument is refused (``ConfigError`` naming ``callbacks.<name>``) before anything is written.
    An injected fault must strike in this run (``run/faults.check_injections``).
    The run's record (an ``ArtifactDumpCallback``: ``run.json``) also gets what no key holds: the
    resolved config and the LoRA shapes of ``facts``. Lightning runs the step checkpoint (a
    ``Checkpoint``) last."""
    from hydra.utils import get_object, instantiate
    from lightning.pytorch.callbacks import Callback, Checkpoint

    from atlas_lightning.callbacks.artifacts import ArtifactDumpCallback
    from atlas_lightning.run.callback_arguments import check_callback_arguments
    from atlas_lightning.run.faults import check_injections
    from atlas_lightning.store.checkpoints import checkpoint_step

    record = {"config": OmegaConf.to_container(cfg, resolve=True), "lora": dict(facts.lora) if facts else None}
    callbacks, named = [], {}
    for name, spec in (cfg.callbacks or {}).items():
        if spec is None:
            continue
        arguments = {k: v for k, v in OmegaConf.to_container(spec, resolve=True).items() if not k.startswith("_")}
        try:
            target = get_object(spec._target_)  # resolved at compose; a config changed since may not
        except Exception as err:
            raise ConfigError(f"callbacks.{name}: cannot build {spec.get('_target_')}: {err}") from None
        check_callback_arguments(name, target, arguments, cfg=cfg)
        try:
            build = instantiate(spec, _partial_=True)
            records_the_run = isinstance(build.func, type) and issubclass(build.func, ArtifactDumpCallback)
            callbacks.append(build(**record) if records_the_run else build())
        except Exception as err:  # a bad class path or argument, named for the user
            raise ConfigError(f"callbacks.{name}: cannot build {spec.get('_target_')}: {err}") from err
        if not isinstance(callbacks[-1], Callback):  # Lightning would fail on its first hook, mid-run
            raise ConfigError(f"callbacks.{name}._target_={spec.get('_target_')} built a "
                              f"{type(callbacks[-1]).__name__}, not a Lightning callback "
                              f"(lightning.pytorch.Callback; atlas_lightning.callbacks.base.RLCallback)")
        named[name] = callbacks[-1]
    resumed = checkpoint_step(facts.start.resume) if facts is not None and facts.start.resume is not None else 0
    check_injections(named, cfg, resumed_step=resumed)  # an injected fault must strike in this run
    # as Lightning orders them: checkpoints after every other callback
    return sorted(callbacks, key=lambda callback: isinstance(callback, Checkpoint))


def build_trainer(cfg: DictConfig, callbacks: Optional[list] = None, loggers: Optional[list] = None,
                  limit_val_batches: int = 0, *, progress_bar: bool = True, checkpointing: bool = True):
    """The ``lightning.Trainer`` every verb runs on: ``cfg.trainer``'s devices and precision (its
    accelerator: ``run/accelerator.build_accelerator``),
    ``build_strategy``, one epoch, no sanity validation, ``outputs/<name>/`` as its root.
    ``callbacks`` and ``loggers`` default to the configured ones (``build_callbacks``, ``build_loggers``; ``[]`` for none);
    ``limit_val_batches`` is 0 for ``fit`` (validation is a callback) and 1 for ``validate``;
    ``progress_bar=False`` and ``checkpointing=False`` (no Lightning ``ModelCheckpoint`` added
    in place of the step checkpoint) for the memory check, which saves nothing but its report."""
    import lightning as L

    from atlas_lightning.run.accelerator import build_accelerator

    t = cfg.trainer
    return L.Trainer(
        accelerator=build_accelerator(cfg),
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
        default_root_dir=str(cfg.paths.outputs),
        enable_model_summary=False,
        enable_progress_bar=progress_bar,
        enable_checkpointing=checkpointing,
    )
