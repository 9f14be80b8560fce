"""Faults that stop a fit part-way, turned into a clean stop that names the cause.

These faults can end a run after it has started training, whatever the care taken before:

* the rollout engine dies (its process killed, its engine core gone) or stops serving what it
  was sent: ``EngineError`` (the agent loop's, after its retries) or ``WeightSyncError`` (the
  weight sync's proof failed; a starting check that the engine ignores the adapter is an input
  error instead, exit 2);
* the card runs out of memory: ``torch.OutOfMemoryError`` (the step adds which phase of which
  RL step, ``PPOModule._phase``);
* a step's values are not finite and the NaN guard stops: ``NonFiniteError``;
* a file of the run cannot be written: a checkpoint's (``CheckpointWriteError``, on every rank:
  the folder being written never gets its marker, the previous complete checkpoint is untouched)
  or any other (``OSError``: the disk full, a quota, a read-only file system, a permission
  taken away);
* SIGINT (Ctrl-C) or SIGTERM arrives (``run/interrupts.py``: exit 130, 143; under SIGTERM the
  step under way finishes first, as Lightning does);
* the user's own code the config names (a reward scorer, a callback) raises, or the scorer's
  output breaks its contract (``run/user_code.py``: exit 8, its traceback in the run's log).

Any other error is a bug: it keeps its traceback, to which a last note adds the last step
trained and the checkpoint to resume from.

Under several ranks a fault may strike one rank while the others wait for it in a collective:
the rank that stops tells the others (``run/stop_notice.py``), and each of them, its collective
failed, stops with the same cause and exit code, naming the rank that stopped and why.

``stops_cleanly`` lets each propagate through Lightning (its exception hooks run first: the step
checkpoint finishes a write in flight, ``callbacks/checkpoint.py``) and raises ``RunStopped``
(``errors.py``) in its place, whose message names the cause, the last RL step trained and the
newest checkpoint that verifies against its ``checkpoint.json`` (rank 0 verifies it; no
collective: other ranks may be gone), and is written to the run's log. The CLI prints it, no
traceback, and exits with its code (4 engine, 5 out of memory, 6 non-finite, 7 a write, 8 the
user's code, 130 SIGINT, 143 SIGTERM). Nothing of the
failed step is checkpointed, so ``trainer.resume=auto`` continues from that checkpoint.
"""

from __future__ import annotations

import errno
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from atlas_lightning import distributed as dist_utils
from atlas_lightning.errors import CheckpointWriteError, InputError, NonFiniteError, RunStopped
from atlas_lightning.run import interrupts, stop_notice
from atlas_lightning.run.user_code import UserCode, blame

log = logging.getLogger("atlas_lightning")


@contextmanager
def stops_cleanly(checkpoints: Path, last_step: Callable[[], int], trainer: Optional[Any] = None,
                  user: Sequence[UserCode] = ()) -> Iterator[None]:
    """Run the body (``trainer.fit``); a fault of the module doc becomes ``RunStopped``.
    ``last_step()``: the last RL step the module finished (read when the fault is caught).
    ``trainer``: the one fitting, told when its rank handles a fault (``stop_notice.watching``).
    ``user``: the user's own code the run calls (``run/user_code.user_code``): an error of it stops too."""
    last_step = _counting_restored(last_step, trainer)
    try:
        with stop_notice.watching(trainer):  # another rank's stop reaches this one (several ranks)
            yield
    except InputError:  # a starting check: exit 2 as before any work
        raise
    except Exception as err:
        stop = _as_stop(err, checkpoints, last_step, user)
        if stop is None:  # a bug: its traceback, then where the run can resume from
            err.add_note(f"the run stopped after RL step {last_step()} (the last one finished); "
                         f"{_last_good(checkpoints, before_step=last_step() + 1)[1]}")
            raise
        raise stop from err
    except (KeyboardInterrupt, SystemExit, interrupts.Terminated) as err:  # SIGINT, SIGTERM (run/interrupts.py)
        received = interrupts.signal_of(err)
        if received is None:
            raise
        raise _interrupted(received, checkpoints, last_step()) from None


def _counting_restored(last_step: Callable[[], int], trainer: Optional[Any]) -> Callable[[], int]:
    """``last_step`` never below the RL step of the checkpoint ``trainer`` resumes from
    (``trainer.ckpt_path``, set as its restore begins): the module records that step only once
    Lightning has loaded the state, and a fault before then (the restore itself failing) would
    otherwise name a checkpoint before step 1, none, though the one being read is intact."""
    from atlas_lightning.store.checkpoints import checkpoint_step

    def reached() -> int:
        try:  # a stop's detail: nothing here may raise in its place
            parts = reversed(Path(str(trainer.ckpt_path)).parts) if getattr(trainer, "ckpt_path", None) else ()
            restored = next((step for step in map(checkpoint_step, parts) if step is not None), 0)
        except Exception:
            restored = 0
        return max(last_step(), restored)

    return reached


def _as_stop(err: Exception, checkpoints: Path, last_step: Callable[[], int],
             user: Sequence[UserCode] = ()) -> Optional[RunStopped]:
    """``err`` as the clean stop of a fault of the module doc, told to the other ranks; or the
    stop of another rank that ``err`` (a collective that failed) followed; else None."""
    stop = _fault_stop(err, checkpoints, last_step) or _user_code_stop(err, user, checkpoints, last_step)
    if stop is not None:
        stop_notice.publish(stop)
        return stop
    notice = stop_notice.received()
    if notice is None:
        return None
    message = f"rank {notice['rank']} stopped, so this rank {dist_utils.rank()} did: {notice['message']}"
    log.error("stopped: %s", message)
    return RunStopped(message, cause=notice["cause"])


def _fault_stop(err: Exception, checkpoints: Path, last_step: Callable[[], int]) -> Optional[RunStopped]:
    """The clean stop of a fault of the module doc, or None for any other error."""
    from atlas_lightning.rollout.engine import EngineError
    from atlas_lightning.rollout.sync_probe import WeightSyncError

    if isinstance(err, (EngineError, WeightSyncError)):
        return _stopped("engine", "the rollout engine failed", err, checkpoints, last_step())
    if isinstance(err, torch.OutOfMemoryError):
        return _stopped("out_of_memory", "out of memory", err, checkpoints, last_step(),
                        hint="lower algorithm.ppo_max_token_len_per_gpu or algorithm.forward_max_token_len_per_gpu "
                             "(atlas-lightning plan prints what fits)")
    if isinstance(err, NonFiniteError):  # its message already names the step and the last good checkpoint
        message = f"non-finite values: {err}"
        log.error("stopped: %s", message)
        return RunStopped(message, cause="non_finite", last_good_checkpoint=err.last_good_checkpoint)
    if isinstance(err, CheckpointWriteError) or (isinstance(err, OSError) and err.errno in DISK_ERRORS):
        what = "a checkpoint could not be written" if isinstance(err, CheckpointWriteError) else \
            "a file of the run could not be written"
        return _stopped("write", what, err, checkpoints, last_step(),
                        hint=_space_hint(err, checkpoints) or _free_space(checkpoints))
    return None


#: ``OSError`` numbers of a write the storage refused (what ``stops_cleanly`` stops on): full,
#: over quota, read-only, failing, too large, or the permission taken away while the run went on
#: (every folder's permission is checked before any work: ``run/facts.check_writable``).
DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG, errno.EACCES, errno.EPERM}


def _space_hint(err: BaseException, checkpoints: Path) -> Optional[str]:
    """What to do when the disk is full (``err`` or what it was raised from)."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"free space on the file system of {checkpoints} before resuming"
        if isinstance(err, OSError) and err.errno in (errno.EACCES, errno.EPERM):
            return f"give this user write permission on {err.filename or 'the folder named'} before resuming"
        err = err.__cause__
    return None


def _free_space(checkpoints: Path) -> Optional[str]:
    """The free space of ``checkpoints``' file system, against the last complete checkpoint's size,
    where the error does not say why the write failed: torch's writers raise a full disk as a
    ``RuntimeError`` of their own (``unexpected pos 704 vs 598`` from its zip writer), no errno."""
    import shutil

    from atlas_lightning.store.checkpoints import latest_complete

    folder = Path(checkpoints)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:  # a stop's hint: nothing here may raise in its place
        free = shutil.disk_usage(folder).free
        last = latest_complete(checkpoints)
        size = sum(f.stat().st_size for f in last.rglob("*") if f.is_file()) if last is not None else 0
    except OSError:
        return None
    said = f"the file system of {checkpoints} has {_amount(free)} free"
    if free < size:
        return f"{said}, less than the last checkpoint's {_amount(size)}: free space there before resuming"
    return said + (f" (the last checkpoint took {_amount(size)})" if last is not None else "")


def _amount(size: int) -> str:
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def _stopped(cause: str, what: str, err: BaseException, checkpoints: Path, step: int,
             hint: Optional[str] = None) -> RunStopped:
    detail = " ".join(str(err).split()) or type(err).__name__
    notes = "; ".join(getattr(err, "__notes__", []))
    checkpoint, resume = _last_good(checkpoints, before_step=step + 1)
    message = (f"{what} after RL step {step} (the last one finished){f' ({notes})' if notes else ''}: "
               f"{type(err).__name__}: {detail}; nothing of the failed step is checkpointed; {resume}"
               + (f"; {hint}" if hint else ""))
    log.error("stopped: %s", message)
    return RunStopped(message, cause=cause, last_good_checkpoint=checkpoint)


def _user_code_stop(err: Exception, user: Sequence[UserCode], checkpoints: Path,
                    last_step: Callable[[], int]) -> Optional[RunStopped]:
    """The stop of an error raised by the user's own code (``run/user_code.py``), exit 8; else None."""
    found = blame(err, list(user))
    if found is None:
        return None
    log.error("the user's %s=%s raised:", found.code.key, found.code.target, exc_info=err)
    what = f"{found.code.key}={found.code.target} (the user's code) raised at {found.line}"
    return _stopped("user_code", what, found.error, checkpoints, last_step(),
                    hint="its traceback is in the run's log; fix it, then resume")


def _interrupted(received: str, checkpoints: Path, step: int) -> RunStopped:
    """The stop of a run that ``received`` (``"SIGINT"``, ``"SIGTERM"``) ended after RL step ``step``."""
    checkpoint, resume = _last_good(checkpoints, before_step=step + 1)
    message = (f"interrupted by {interrupts.NAMES[received]} after RL step {step} (the last one finished); "
               f"nothing of a step under way is checkpointed; {resume}")
    log.error("stopped: %s", message)
    return RunStopped(message, cause=interrupts.CAUSES[received], last_good_checkpoint=checkpoint)


def _last_good(checkpoints: Path, before_step: int) -> tuple[Optional[Path], str]:
    """The newest checkpoint before ``before_step`` that verifies (a resumed run may hold later
    folders of its first attempt), and the sentence that says how to resume from it."""
    from atlas_lightning.store.checkpoints import latest_complete, latest_verified

    if not dist_utils.is_rank_zero():  # rank 0 verifies; the others name what its marker says
        folder = latest_complete(checkpoints, before_step=before_step)
        return folder, f"the last complete checkpoint is {folder} (rank 0 verifies it)"
    folder, refusals = latest_verified(checkpoints, before_step=before_step)
    for reason in refusals:
        log.warning("a checkpoint that does not verify: %s", reason)
    if folder is None:
        return None, f"there is no complete checkpoint under {checkpoints} to resume from"
    return folder, f"the last complete checkpoint is {folder} (verified); resume with trainer.resume=auto"


def check_injections(callbacks: dict[str, Any], cfg: Any, resumed_step: int) -> None:
    """Each ``FaultInjection`` among ``callbacks`` (by their ``callbacks.<name>``) strikes in this
    run: its step is one the run trains (after ``resumed_step``, up to ``trainer.total_steps``),
    checkpointed there (``checkpoint_write``) or validated there alone (``phase=validation``), its rank
    one of the run's, its engine one it can kill (a process this rank started: not ``hf``, not a
    ``rollout.server_url``, rank 0's in the separate layout). Otherwise the run would end as if
    it had met the fault and survived it. ``ConfigError`` naming the key (before anything is written)."""
    from atlas_lightning.callbacks.checkpoint import StepCheckpoint
    from atlas_lightning.callbacks.faults import FaultInjection
    from atlas_lightning.callbacks.validation import ValidationCallback
    from atlas_lightning.config import ConfigError

    total, world = int(cfg.trainer.total_steps), int(cfg.trainer.devices) * int(cfg.trainer.num_nodes)
    saver = next((c for c in callbacks.values() if isinstance(c, StepCheckpoint)), None)
    validation = next((c for c in callbacks.values() if isinstance(c, ValidationCallback)), None)
    for name, fault in callbacks.items():
        if not isinstance(fault, FaultInjection):
            continue
        step, why = fault.step, None
        if not resumed_step < step <= total:
            why = f"the run trains RL steps {resumed_step + 1}..{total}"
        elif (fault.fault == "checkpoint_write" or fault.phase == "checkpoint") \
                and not (saver is not None and saver.saves_at(step, total)):
            why = "no checkpoint is written at that step (trainer.save_every)"
        elif fault.phase == "validation" and not (validation is not None and validation.should_validate(step, total)):
            why = "no validation runs at that step (trainer.val_every)"
        elif fault.phase == "validation" and validation.overlap and step < total and cfg.layout.mode == "colocated":
            why = "that step's validation rides with the next training rollout (callbacks.validation.overlap=true)"
        elif fault.rank is not None and fault.rank >= world:
            why = f"the run has {world} rank(s)"
        elif fault.fault == "engine_kill" and cfg.rollout.engine == "hf":
            why = "the hf engine runs in the trainer's process: there is no engine process to kill"
        elif fault.fault == "engine_kill" and cfg.rollout.get("server_url"):
            why = "the run attaches to a server it did not start (rollout.server_url): it holds no process to kill"
        elif fault.fault == "engine_kill" and cfg.layout.mode == "separate" and world > 1 and fault.rank != 0:
            why = "in the separate layout rank 0 alone holds the server's process: set +callbacks.fault_injection.rank=0"
        if why is not None:
            raise ConfigError(f"callbacks.{name}: {fault.fault} at RL step {step}"
                              f"{'' if fault.rank is None else f' on rank {fault.rank}'} would never happen: {why}")
