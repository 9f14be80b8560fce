"""``BackgroundDrawing``: one spawned process that draws a partition's figures while the run goes on.

Why a process: drawing a training figure set costs about 0.3 s of Python (matplotlib's artists
and Agg), about 1% of a step on one card. A thread would hold the GIL against the in-process
engine's decode loop and the update's kernel launches; a process of its own takes a core the
card's host leaves idle. It is started with ``spawn`` (never ``fork``: the run holds CUDA, NCCL
and the engine's threads) on the first ``submit``, imports only ``callbacks/plots.py`` (matplotlib)
and lives until ``close``.

Contract: at most one drawing is pending. ``submit`` hands it a history (plain, picklable
summaries) and returns at once; ``wait`` returns ``(step, paths)`` once the files are written,
re-raising whatever the drawing raised (a bug: the figures are pure functions of the history).
If the process itself dies (killed, out of memory, or unable to import the drawing), ``wait``
draws the pending set in this process, warns once, and every later ``submit`` draws here too:
the files are never lost. The process ignores SIGINT: Ctrl-C reaches the whole process group,
and the run, not the drawing, decides what follows (it waits for a pending drawing).
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Mapping, Optional, Sequence

from atlas_lightning.callbacks.plots import draw_partition, ready

log = logging.getLogger(__name__)


class BackgroundDrawing:
    """See the module docstring. Not thread-safe; one per ``FiguresCallback``, on rank 0."""

    def __init__(self) -> None:
        self._pool: Optional[ProcessPoolExecutor] = None
        self._broken = False
        #: (step, the drawing's arguments, its future) of the drawing not yet waited for
        self._pending: Optional[tuple[int, tuple, Future]] = None

    def start(self) -> None:
        """Start the process now, and have it import what drawing needs, without waiting for it.

        ``spawn`` runs a new interpreter that also imports the run's main module (a heavy one for
        ``python -m atlas_lightning.bench.step``: torch, transformers, vLLM), several seconds on a
        GPU host; started with the run, that overlaps the model's build and the engine's start
        instead of the first step (which waited 2.6 s for it at 16 layers on an H100). Idempotent."""
        if self._pool is not None or self._broken:
            return
        # Ctrl-C reaches the whole process group: the run decides what happens to a pending
        # drawing (it waits for it), so the drawing process ignores SIGINT
        self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=signal.signal, initargs=(signal.SIGINT, signal.SIG_IGN))
        self._pool.submit(ready)  # its failure shows at the first drawing (BrokenProcessPool: drawn here)

    @property
    def pending_step(self) -> Optional[int]:
        """The step whose figures are being drawn, None when nothing is pending."""
        return None if self._pending is None else self._pending[0]

    def submit(self, step: int, history: Sequence[Mapping], partition: str, folder: Path, dpi: int) -> None:
        """Start drawing ``partition``'s figures of ``history`` into ``folder``; the previous
        drawing must have been waited for."""
        if self._pending is not None:
            raise RuntimeError(f"BackgroundDrawing: step {self._pending[0]}'s figures are still pending")
        args = ([dict(h) for h in history], partition, Path(folder), dpi)
        future: Optional[Future] = None
        if not self._broken:
            self.start()
            try:
                future = self._pool.submit(draw_partition, *args)
            except BrokenProcessPool as err:
                self._give_up(step, err)
        if future is None:
            future = Future()
            future.set_result(draw_partition(*args))
        self._pending = (step, args, future)

    def wait(self) -> Optional[tuple[int, list[Path]]]:
        """The pending drawing's ``(step, paths)`` once written (None when nothing is pending)."""
        if self._pending is None:
            return None
        step, args, future = self._pending
        self._pending = None
        try:
            return step, future.result()
        except BrokenProcessPool as err:
            self._give_up(step, err)
            return step, draw_partition(*args)

    def close(self) -> None:
        """End the process, after the pending drawing if any (``wait`` first to have its result)."""
        self._pending = None
        self._shutdown()

    def _give_up(self, step: int, err: BaseException) -> None:
        log.warning("the figures' drawing process ended before drawing step %d's figures (%s); they are drawn "
                    "in the run's own process from now on", step, err)
        self._broken = True
        self._shutdown()

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
