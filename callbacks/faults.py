"""``FaultInjection``: one real fault at a chosen RL step, to prove the run stops cleanly and resumes.

Not in the default callbacks; a run takes it with

    +callbacks.fault_injection._target_=atlas_lightning.callbacks.faults.FaultInjection
    +callbacks.fault_injection.fault=<engine_kill|out_of_memory|non_finite|checkpoint_write|sigint|sigterm> \
    +callbacks.fault_injection.step=N [+callbacks.fault_injection.phase=<rollout|sync|validation|update|checkpoint>] \
    [+callbacks.fault_injection.rank=R]

The faults (``run/faults.py`` turns each into a clean stop that names it; exit 4, 5, 6, 7, 130, 143):

* ``engine_kill``: the engine is killed (a server engine's process gets SIGKILL; the in-process
  vLLM engine's engine core is shut down: it shares the trainer's process, nothing else of it
  can die alone) at ``phase`` of step N: ``rollout`` (the default), in the middle of step N's
  rollout (its first requests submitted, in flight, before the engine has answered any: the
  agent loop's retries fail); ``sync``, as step N's weight sync starts (its export, load and
  probe then meet a dead engine); ``validation``, in the middle of step N's validation rollout
  (the run must validate at step N). Each ends in ``EngineError`` naming the operation
  (``rollout/engines/failure.py``).
* ``out_of_memory``: as step N's actor update starts (its critic update already applied: the weights in
  memory are half-way through the step), the card runs out of memory: on CUDA a real
  allocation of more than the card has free (the caching allocator raises), on a CPU run
  ``torch.OutOfMemoryError`` raised there.
* ``non_finite``: as step N's actor update starts, one element of an actor LoRA factor becomes NaN (in
  the precision the update runs in: bf16 under a bf16 base), so the update's forward passes give
  NaN log-probs; the step's own check refuses the optimizer step and the NaN guard stops.
* ``sigint``, ``sigterm``: the signal (Ctrl-C; a scheduler's or ``kill``'s) reaches the trainer's
  process at ``phase`` of step N: ``rollout`` (the default, its first requests in flight),
  ``update`` (as the actor update starts) or ``checkpoint`` (while step N's checkpoint is written
  in the background, the next step under way). ``run/interrupts.py`` says how each ends.
* ``checkpoint_write``: step N's checkpoint write (in the background, rank 0) finds the disk
  full (``OSError`` ENOSPC) once the adapters are in its staging folder: the folder never gets
  its marker, and the step that waits for the write (N+1's end, or fit's end) raises
  ``CheckpointWriteError`` on every rank.

With ``rank``, the fault happens on that global rank alone (the others must hear of the stop:
``run/stop_notice.py``); without it, on every rank.

Each fault happens once, in the run that has the callback: a resume without it continues. The
checkpoint of step N-1 (with ``trainer.save_every=1``) is the one to resume from.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import lightning as L
import torch

log = logging.getLogger(__name__)

#: The signals a user or a scheduler sends (``run/interrupts.py``).
SIGNALS = {"sigint": signal.SIGINT, "sigterm": signal.SIGTERM}
FAULTS = ("engine_kill", "out_of_memory", "non_finite", "checkpoint_write", *SIGNALS)
#: Where ``engine_kill`` strikes (module doc).
ENGINE_PHASES = ("rollout", "sync", "validation")
#: Where a signal arrives (module doc).
SIGNAL_PHASES = ("rollout", "update", "checkpoint")


class FaultInjection(L.Callback):
    """Inject ``fault`` (one of ``FAULTS``) at RL step ``step`` (module doc)."""

    def __init__(self, fault: str, step: int, phase: str = "rollout", rank: Optional[int] = None) -> None:
        if fault not in FAULTS:
            raise ValueError(f"FaultInjection: fault must be one of {', '.join(FAULTS)}, got {fault!r}")
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise ValueError(f"FaultInjection: step must be an RL step (an int >= 1), got {step!r}")
        phases = ENGINE_PHASES if fault == "engine_kill" else SIGNAL_PHASES if fault in SIGNALS else ("rollout",)
        if phase not in phases:
            raise ValueError(f"FaultInjection: phase must be one of {', '.join(ENGINE_PHASES)} (other than rollout "
                             f"only for engine_kill), or for {' and '.join(SIGNALS)} one of {', '.join(SIGNAL_PHASES)}; "
                             f"got {phase!r} for {fault}")
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
            raise ValueError(f"FaultInjection: rank must be a global rank (an int >= 0) or None, got {rank!r}")
        self.fault = fault
        self.step = step
        self.phase = phase
        self.rank = rank
        self.done = False

    # -- the update's faults: inside the actor update's phase -------------------------------

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.rank is not None and trainer.global_rank != self.rank:
            self.done = True  # not this rank's fault
            return
        if self.fault in ("out_of_memory", "non_finite") or self.phase in ("sync", "update"):
            hook = getattr(pl_module, "phase_hook", None)
            pl_module.phase_hook = self._phase_hook(hook, trainer, pl_module)
        elif self.fault == "checkpoint_write" or self.phase == "checkpoint":
            self._fill_disk_at_checkpoint(pl_module)
        elif self.phase == "validation":
            self._arm_on(trainer, "validation_rollout", "the validation rollout")
        elif not getattr(trainer.datamodule, "partial_rollouts", True):
            self._arm_on(trainer, "rollout", "the rollout")

    def _phase_hook(self, inner: Any, trainer: L.Trainer, pl_module: L.LightningModule):
        strikes = "update_weights" if self.phase == "sync" else "update_actor"

        @contextmanager
        def hook(name: str, step: int) -> Iterator[None]:
            with (inner(name, step) if inner is not None else _nothing()):
                if name == strikes and step == self.step and not self.done:
                    self.done = True
                    log.warning("fault injection: %s in phase %s of RL step %d", self.fault, name, step)
                    if self.fault == "engine_kill":
                        kill_engine(trainer.datamodule.engine)
                    elif self.fault in SIGNALS:
                        _send(self.fault)
                    elif self.fault == "out_of_memory":
                        _out_of_memory(pl_module.device)
                    else:
                        _poison_actor(pl_module)
                yield
        return hook

    def _arm_on(self, trainer: L.Trainer, method: str, what: str) -> None:
        """The datamodule's ``method`` (``rollout``: a training rollout, whenever it is sampled,
        in the separate layout ahead of its step, possibly before step N-1 has ended;
        ``validation_rollout``) for step N arms the fault at the rollout's first poll."""
        datamodule = trainer.datamodule
        sample = getattr(datamodule, method)

        def armed(step: int, *args, **kwargs):
            if step == self.step and not self.done:
                self._arm(datamodule.engine, f"{what} of RL step {step}")
            return sample(step, *args, **kwargs)

        setattr(datamodule, method, armed)

    def _fill_disk_at_checkpoint(self, pl_module: L.LightningModule) -> None:
        """Step N's checkpoint write finds the disk full once its adapters are written."""
        snapshot = pl_module.snapshot_adapters

        def snapshot_then_fill(into: Any = None) -> Any:
            write_adapters = snapshot(into=into)
            if pl_module.rl_step != self.step or self.done:
                return write_adapters
            self.done = True

            def write_then_fill(folder: Path) -> None:
                write_adapters(folder)
                if self.fault in SIGNALS:  # the write goes on while the main thread meets the signal
                    log.warning("fault injection: %s while writing the checkpoint of RL step %d", self.fault, self.step)
                    _send(self.fault)
                    time.sleep(1.0)
                    return
                log.warning("fault injection: the disk is full while writing the checkpoint of RL step %d", self.step)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder / "lightning"))
            return write_then_fill

        pl_module.snapshot_adapters = snapshot_then_fill

    # -- the engine's death: during the rollout of step N -----------------------------------

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._arm_if_next(trainer, getattr(pl_module, "rl_step", 0))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._arm_if_next(trainer, batch.step)

    def _arm_if_next(self, trainer: L.Trainer, finished: int) -> None:
        """With partial rollouts (no rollout per step to arm, ``_arm_on``): after step
        ``finished``, the next rollout polled is taken for step ``finished + 1``'s."""
        if self.fault not in ("engine_kill", *SIGNALS) or self.phase != "rollout" or self.done \
                or finished + 1 != self.step or not getattr(trainer.datamodule, "partial_rollouts", False):
            return
        self._arm(trainer.datamodule.engine, f"the rollout of RL step {self.step}")

    def _arm(self, engine: Any, during: str) -> None:
        """The engine dies (or the signal arrives) at its next ``poll`` (its first requests
        submitted, in flight)."""
        poll = engine.poll

        def kill_then_poll(*args, **kwargs):
            if not self.done:
                self.done = True
                log.warning("fault injection: %s during %s", self.fault, during)
                _send(self.fault) if self.fault in SIGNALS else kill_engine(engine)
            return poll(*args, **kwargs)

        engine.poll = kill_then_poll


def kill_engine(engine: Any) -> None:
    """The engine dies: a server's process gets SIGKILL (its whole process group), the in-process
    vLLM engine's core is shut down."""
    server = getattr(engine, "server", None)
    process = getattr(server, "process", None)
    if process is not None:
        os.killpg(process.pid, signal.SIGKILL)
        return
    core = getattr(getattr(engine, "_engine", None), "engine_core", None)
    if core is None:
        raise ValueError(f"FaultInjection: cannot kill a {type(engine).__name__} engine (neither a server's "
                         f"process nor an in-process vLLM engine core)")
    core.shutdown()


def _send(fault: str) -> None:
    """The signal of ``fault`` to this process, as ``kill`` or Ctrl-C sends it (handled in the main thread)."""
    os.kill(os.getpid(), SIGNALS[fault])


def _out_of_memory(device: torch.device) -> None:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        torch.empty(free + 2**30, dtype=torch.uint8, device=device)  # the caching allocator raises
    raise torch.OutOfMemoryError("out of memory (FaultInjection on a CPU run: the fault a card raises here)")


def _poison_actor(pl_module: L.LightningModule) -> None:
    """One element of the first actor LoRA factor this rank holds a piece of becomes NaN (a
    sharded factor: in this rank's shard; every rank's forward gathers it)."""
    with torch.no_grad():
        for param in pl_module.model.actor_parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            if local.numel():
                local.view(-1)[0] = float("nan")
                return


@contextmanager
def _nothing() -> Iterator[None]:
    yield
