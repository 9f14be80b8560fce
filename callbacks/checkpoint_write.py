"""One checkpoint folder written in two halves, so that the writing can overlap the next step.

``stage_checkpoint`` (at the step's end, on the main thread, collective: every rank calls it)
takes host copies of everything the folder will hold: the two adapters
(``Checkpointable.snapshot_adapters``) and Lightning's resumable state (what
``trainer.save_checkpoint`` dumps first: the trainable tensors, both optimizers' AdamW moments,
the loops, the callbacks' states, the data cursor, the module's record). They are copies, so the
next update cannot change what is being written. With partial rollouts the trajectories in
flight are copied too, at a cut (``rollout/inflight.py``), and written by rank 0 under
``inflight/``, which the marker lists like every other part. ``StagedCheckpoint.write`` then writes the
files from those copies into ``.tmp-global_step_N/`` and, on rank 0 once every rank's files are
complete, moves them into ``global_step_N/``, writes ``checkpoint.json`` (sizes, sha256s; last,
atomically) and ``latest_checkpointed_iteration.txt``. ``write`` runs no collective on the
process group the step uses, so it may run on a background thread while the next step runs. A
process killed at any moment leaves ``global_step_N/`` without its marker: not a checkpoint
(``store/checkpoints.py``), and the previous complete one is what a resume finds.

The host copies go into memory kept for the run (``HostStaging``, one per ``StepCheckpoint``),
not memory allocated at every save: the staging is the part of a checkpoint the step waits for,
and fresh pageable memory, faulted in page by page and copied one tensor at a time, ran at
~0.8 GB/s on an H100. Lightning's state goes through one torch ``StateDictStager`` for the run
(``ReusedHostStager``), which keeps a host copy per source storage, and the LoRA factors and AdamW moments
keep their storages from step to step, so from the second save on each is copied into the same
host memory. The adapters are gathered whole into new tensors at every save (under FSDP2 by
``full_tensor``), which a cache keyed by storage would miss every time (a second stager would
allocate, and pin, afresh at every save): they go into ``models/adapters.HostBuffers``, keyed by
name. On CUDA both are pinned (page-locked) and copied without waiting on each tensor, then
synchronized once per call; on CPU they are plain host memory, reused all the same. The cost:
that host memory stays allocated for the run, the size of what is staged on each rank (under
FSDP2 its shards of the trainable tensors and of both optimizers' moments; on rank 0 also both
adapters whole and the rest of Lightning's state); pinned on CUDA.

Reusing it is safe because of one order: each save's copies overwrite the previous save's, so
nothing may stage while the previous write still reads them. ``StepCheckpoint.save`` waits for
that write (``finish_pending``) before it stages, and ``HostStaging.begin`` refuses to stage
until the checkpoint staged last has ``finished`` (its write ended, well or not, torch's writer
of the shards included). Nothing else stages into this memory: the weight sync's adapter export
(``models/adapters.save_adapter``), which runs during the next step while a write may be under
way, keeps host buffers of its own (``rollout/sync.py``).

The Lightning state keeps its two formats (``store/checkpoints.py``):

* under FSDP2 (``ModelParallelStrategy``) a torch.distributed checkpoint folder, written by
  torch's own ``async_save``: it stages the state with the stager it is given
  (``async_stager=``, the run's ``ReusedHostStager``: a copy, made before it returns; torch does not
  close a stager it is given) and writes it on a thread of its own, each rank its shards. That is
  the state's one host copy: ``TrainableStateStrategy`` hands the shards over where they live
  (on the card), where Lightning's own strategy would offload them to the host first
  (``cpu_offload``), a second copy of the same bytes (``run/strategy.py``). Its
  planning and metadata collectives run on a gloo group made for checkpoints alone
  (``new_checkpoint_group``), never on the group the step's collectives use (two threads on one
  group would interleave their messages). Rank 0 adds Lightning's ``meta.pt`` (the rest of
  the state), as ``ModelParallelStrategy.save_checkpoint`` does;
* otherwise ``state.ckpt``, written by rank 0 through the strategy's ``CheckpointIO`` from a
  host copy made by the same stager.

Why not Lightning's ``AsyncCheckpointIO``: ``ModelParallelStrategy`` does not write its
distributed checkpoints through ``CheckpointIO``, the plugin clones the state on the device (a
second copy of it in GPU memory, not the host) and it reports no completion to write the marker
after.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from concurrent.futures import wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
# imported with the callback, not at the first save (a fifth of a second, once, inside a step)
from torch.distributed.checkpoint import async_save
# torch's own stager, private: DefaultStager, its public wrapper, cannot be kept (ReusedHostStager)
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.staging import AsyncStager

from atlas_lightning import distributed as dist_utils
from atlas_lightning.models.adapters import HostBuffers
from atlas_lightning.store.atomic import atomic_write_text
from atlas_lightning.rollout import inflight
from atlas_lightning.store.checkpoints import LATEST, MARKER, OPTIONAL_PARTS, PARTS, STATE_DIR, step_dir, write_marker


def staging_dir(checkpoints: Path, step: int) -> Path:
    """Where step ``step``'s files are written before they move into ``global_step_<step>``
    (a name ``checkpoint_step`` does not parse: never taken for a checkpoint)."""
    return Path(checkpoints) / f".tmp-global_step_{step}"


def writes_sharded_state(strategy: Any) -> bool:
    """FSDP2 (``ModelParallelStrategy``) saves a torch.distributed checkpoint folder, also at world 1:
    the strategy decides the format, not the world size."""
    return isinstance(strategy, ModelParallelStrategy)


def new_checkpoint_group() -> Any:
    """A gloo process group of every rank, for the checkpoint writes' own collectives (module
    doc). Collective: every rank calls it, at the same point."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


class ReusedHostStager(AsyncStager):
    """torch's ``StateDictStager`` kept for the run, as ``async_save``'s stager and for
    ``state.ckpt``: ``stage`` returns a host copy of a state (every tensor copied, other values
    deep-copied), each tensor into the copy made for the same source storage at an earlier
    stage; on CUDA pinned and copied without waiting on each tensor, then synchronized once.

    Why not torch's ``DefaultStager``: in some torch releases (2.11, the card's) its ``stage``
    closes the ``StateDictStager`` after every call. That drops the copies (the next save
    allocates and pins them all again) and clears its deep-copy table, so the second stage of a
    state holding a class object fails with ``KeyError: <class 'type'>`` (a fit's second
    checkpoint on the card). This stager is closed once, by ``HostStaging.close``."""

    _synchronize_after_execute = False  # ``stage`` returns a finished copy: nothing to wait for

    def __init__(self, on_cuda: bool) -> None:
        self.on_cuda = on_cuda
        self._stager = StateDictStager(pin_memory=on_cuda, share_memory=False)

    def stage(self, state_dict: Any) -> Any:
        staged = self._stager.stage(state_dict, non_blocking=self.on_cuda)
        if self.on_cuda:
            torch.cuda.synchronize()  # the copies were queued without waiting: done before returning
        return staged

    def synchronize_staging(self) -> None:
        """Nothing: ``stage`` has finished its copies when it returns."""

    def close(self) -> None:
        self._stager.close()


class HostStaging:
    """The host memory a ``StepCheckpoint``'s saves are staged in, kept for the run (module doc):
    a ``ReusedHostStager`` for Lightning's state (``stage``; also what ``async_save`` stages
    with, ``async_stager=stager``) and name-keyed ``HostBuffers`` for the adapters (``adapters``).
    On CUDA (``on_cuda``) both are pinned and copied without waiting on each tensor, then
    synchronized once per call; elsewhere plain host memory, still reused.

    Each save overwrites the previous save's copies, so nothing may stage here while a write from
    them is under way: ``begin`` refuses to unless the write of the checkpoint staged last has
    ended (``StagedCheckpoint.finished``); ``StepCheckpoint.save`` waits for it first. Not
    thread-safe: the main thread stages."""

    def __init__(self, on_cuda: bool) -> None:
        self.stager = ReusedHostStager(on_cuda)
        self.adapters = HostBuffers(pinned=on_cuda)
        self._staging_step: Optional[int] = None
        #: the step staged here last and its ``finished`` (not the checkpoint: its copies may go)
        self._last: Optional[tuple[int, threading.Event]] = None

    def begin(self, step: int) -> None:
        """Step ``step``'s copies are about to overwrite the buffers: refuse while anything reads them."""
        if self._staging_step is not None:
            raise RuntimeError(f"step {step}'s checkpoint cannot be staged: the staging of step "
                               f"{self._staging_step}'s failed midway, and its write may still read the host copies")
        if self._last is not None and not self._last[1].is_set():
            raise RuntimeError(f"step {step}'s checkpoint cannot be staged: the write of step {self._last[0]}'s "
                               f"still reads the host copies it would overwrite (wait for it first)")
        self._staging_step = step

    def stage(self, obj: Any) -> Any:
        """``obj`` with every tensor copied to host memory (a copy even of a tensor already there),
        into the copies the previous save was staged in where the source's storage is the same."""
        return self.stager.stage(obj)

    def warm(self, obj: Any) -> None:
        """Stage ``obj`` once and drop the copies: the host memory made for them stays with the
        stager (a copy per source storage), so a later save of the same storages copies into it.
        Refused, as ``begin``, while a write reads the copies."""
        self.begin(0)
        try:
            self.stager.stage(obj)
        finally:
            self._staging_step = None

    def lend(self, staged: "StagedCheckpoint") -> "StagedCheckpoint":
        """``staged`` (begun with ``begin``) reads the buffers until its write has ended."""
        self._staging_step, self._last = None, (staged.step, staged.finished)
        return staged

    def close(self) -> None:
        """Let the memory go (a write still under way keeps the copies it holds)."""
        self.stager.close()
        self.adapters.clear()


@dataclass
class StagedCheckpoint:
    """Step ``step``'s checkpoint as host copies, and how to write it (module doc).

    ``write_adapters(folder)``: the module's adapter writer (rank 0 writes). ``state``: on rank
    0, the host copy of Lightning's state (``state.ckpt``) or, beside ``sharded``, of the rest
    of it (``meta.pt``); None elsewhere. ``sharded``: ``async_save``'s future (FSDP2).
    ``checkpoint_io``: what writes ``state.ckpt``."""

    step: int
    checkpoints: Path
    write_adapters: Callable[[Path], None]
    state: Optional[dict]
    sharded: Any = None
    checkpoint_io: Any = None
    #: Rank 0: the trajectories in flight at the cut, ``{file name: bytes}`` (``rollout/inflight.py``).
    inflight: Optional[dict] = None
    #: Set once ``write`` has ended, well or not, torch's writer of the shards included: nothing
    #: reads the host copies any more (``HostStaging.begin``).
    finished: threading.Event = field(default_factory=threading.Event)

    @property
    def folder(self) -> Path:
        return step_dir(self.checkpoints, self.step)

    def write(self) -> None:
        """Write every file, then (rank 0) move them into place and write the marker last. No
        collective on the step's process group: safe on a background thread."""
        try:
            self._write()
        finally:
            if self.sharded is not None:  # an error above may have come before the shards were written
                wait([self.sharded])
            self.finished.set()

    def _write(self) -> None:
        tmp, rank_zero = staging_dir(self.checkpoints, self.step), dist_utils.is_rank_zero()
        if rank_zero:
            self.write_adapters(tmp)
            if self.inflight:
                inflight.write(self.inflight, tmp)
        if self.sharded is not None:
            from lightning.fabric.strategies.fsdp import _METADATA_FILENAME
            import torch

            # rank 0's save returns once every rank's shards and the index are written
            self.sharded.result()
            if rank_zero:
                torch.save(self.state, tmp / STATE_DIR / _METADATA_FILENAME)
        elif rank_zero:
            self.checkpoint_io.save_checkpoint(self.state, tmp / STATE_DIR / "state.ckpt")
        if rank_zero:
            publish(tmp, self.folder, self.step, self.checkpoints)


def publish(tmp: Path, final: Path, step: int, checkpoints: Path) -> None:
    """Move the written parts from ``tmp`` into ``final`` (kept: its ``val_dumps/``), then the
    marker, then ``latest_checkpointed_iteration.txt``. A kill before the marker leaves no
    checkpoint at ``final``."""
    final.mkdir(parents=True, exist_ok=True)
    (final / MARKER).unlink(missing_ok=True)
    for part in PARTS + OPTIONAL_PARTS:
        shutil.rmtree(final / part, ignore_errors=True)
        if part in PARTS or (tmp / part).exists():
            os.replace(tmp / part, final / part)
    shutil.rmtree(tmp, ignore_errors=True)
    write_marker(final, step)
    atomic_write_text(checkpoints / LATEST, f"{step}\n")


def stage_checkpoint(trainer: Any, pl_module: Any, step: int, checkpoints: Path, staging: HostStaging,
                     group: Any = None) -> StagedCheckpoint:
    """Host copies of step ``step``'s checkpoint in ``staging`` (module doc; refused while the
    previous one's write reads them); under FSDP2 the sharded state's write has already started on
    ``group`` (``new_checkpoint_group``). Collective."""
    staging.begin(step)
    tmp = staging_dir(checkpoints, step)
    rank_zero = dist_utils.is_rank_zero()
    if rank_zero:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / STATE_DIR).mkdir(parents=True)
    dist_utils.barrier()
    # the trajectories in flight, at a cut (partial rollouts; None otherwise). Collective.
    kept = inflight.capture(trainer.datamodule) if trainer.datamodule is not None else None
    write_adapters = pl_module.snapshot_adapters(into=staging.adapters)
    # what trainer.save_checkpoint saves (it dumps, then writes at once)
    checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    if not writes_sharded_state(trainer.strategy):
        return staging.lend(StagedCheckpoint(step, checkpoints, write_adapters,
                                             staging.stage(checkpoint) if rank_zero else None,
                                             checkpoint_io=trainer.strategy.checkpoint_io, inflight=kept))
    tensors = _sharded_part(checkpoint)
    # staged by our stager before it returns (torch does not close a stager it is given, and
    # ours hands back a finished copy: ``ReusedHostStager``)
    future = async_save(tensors, checkpoint_id=tmp / STATE_DIR, process_group=group, async_stager=staging.stager)
    return staging.lend(StagedCheckpoint(step, checkpoints, write_adapters,
                                         staging.stage(checkpoint) if rank_zero else None,
                                         sharded=future, inflight=kept))


def warm_staging(trainer: Any, pl_module: Any, staging: HostStaging) -> None:
    """Make the host memory the run's first save will stage into, now, as ``stage_checkpoint``
    stages: the adapters' buffers, and the stager's copies of every tensor of Lightning's state
    (the trainable tensors and the optimizers' moments, which ``PPOModule`` makes before the first
    update). On a card that memory is pinned, which is slow to make (the 8B's first checkpoint
    blocked step 1 for 4.07 s on an H100, step 2 for 1.15 s): made here, at the fit's start, it is
    no longer inside step 1. Writes nothing. Collective."""
    rank_zero = dist_utils.is_rank_zero()
    pl_module.snapshot_adapters(into=staging.adapters)
    if not all(optimizer.state for optimizer in trainer.optimizers):
        # an optimizer that makes its state at its first step: nothing of it to stage yet, and
        # torch.distributed's state dict would make it now with a step taken (its step count 1)
        return
    checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    if writes_sharded_state(trainer.strategy):
        staging.warm(_sharded_part(checkpoint))  # what async_save stages with this stager, each rank its shards
    if rank_zero:
        staging.warm(checkpoint)


def _sharded_part(checkpoint: dict) -> dict:
    """The tensors of Lightning's ``checkpoint``, taken out of it, as ModelParallelStrategy.save_checkpoint
    lays them out: a distributed checkpoint of them, the rest in ``meta.pt``."""
    tensors = {"state_dict": checkpoint.pop("state_dict")}
    tensors.update({f"optimizer_{index}": state for index, state in enumerate(checkpoint.pop("optimizer_states", []))})
    return tensors


class BackgroundWrite:
    """``staged.write()`` on a thread of its own (``start``), or on the caller's (``run``); its
    error and its seconds are kept for the main loop (``error``, ``write_s``). A daemon thread:
    a process that ends does not wait for it (the folder then has no marker)."""

    def __init__(self, staged: StagedCheckpoint) -> None:
        self.staged = staged
        self.error: Optional[BaseException] = None
        self.write_s = 0.0
        self._thread: Optional[threading.Thread] = None

    def run(self) -> None:
        started = time.monotonic()
        try:
            self.staged.write()
        except BaseException as err:  # the main loop raises it (StepCheckpoint.finish_pending)
            self.error = err
        finally:
            self.write_s = time.monotonic() - started

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=f"checkpoint-write-step-{self.staged.step}", daemon=True)
        self._thread.start()

    def join(self, timeout: Optional[float] = None) -> bool:
        """Wait for the write; False if it is still running after ``timeout`` seconds."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True
