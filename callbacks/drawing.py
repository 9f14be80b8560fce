"""``BackgroundDrawing``: one child process that draws a partition's figures while the run goes on.

Why a process: drawing a training figure set costs about 0.3 s of Python (matplotlib's artists
and Agg), about 1% of a step on one card. A thread would hold the GIL against the in-process
engine's decode loop and the update's kernel launches; a process of its own takes a core the
card's host leaves idle.

Why a plain ``python -m atlas_lightning.callbacks.drawing`` child and not ``multiprocessing``:
``spawn`` re-imports the run's main module in the child (torch, transformers and vLLM for
``python -m atlas_lightning.bench.step``: seconds; a user's own script without a ``__main__``
guard would run again there, a second training on the card), and ``fork`` copies a process that
holds CUDA, NCCL and the engine's threads. The child imports ``callbacks/plots.py`` (matplotlib)
and nothing of the run; it is started by ``start`` (the callback's ``setup``: its start-up
overlaps the model's build and the engine's start) and ends when its input closes (``close``, or
the run's death). It ignores SIGINT: Ctrl-C reaches the whole process group, and the run, not the
drawing, decides what follows (it waits for a pending drawing).

Contract: at most one drawing is pending. ``submit`` hands the child a history (plain, picklable
summaries) and returns at once; ``wait`` returns ``(step, paths)`` once the files are written,
re-raising whatever the drawing raised (a bug: the figures are pure functions of the history).
If the child cannot start or dies (killed, out of memory), ``wait`` draws the pending set in this
process, warns once, and every later ``submit`` draws here too: the files are never lost.

The protocol: each request is one pickle on the child's stdin, ``(history, partition, folder,
dpi)``; each answer one pickle on its stdout, ``("ok", paths)`` or ``("error", exception)``.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Optional, Sequence

from atlas_lightning.callbacks.plots import draw_partition

log = logging.getLogger(__name__)


class BackgroundDrawing:
    """See the module docstring. Not thread-safe; one per ``FiguresCallback``, on rank 0."""

    def __init__(self) -> None:
        self._child: Optional[subprocess.Popen] = None
        self._broken = False
        #: (step, the drawing's arguments) of the drawing not yet waited for
        self._pending: Optional[tuple[int, tuple]] = None

    @property
    def pending_step(self) -> Optional[int]:
        """The step whose figures are being drawn, None when nothing is pending."""
        return None if self._pending is None else self._pending[0]

    def start(self) -> None:
        """Start the child now without waiting for it (idempotent)."""
        if self._child is not None or self._broken:
            return
        # the child finds this package where this process does (an editable install, a checkout)
        path = os.pathsep.join(p for p in sys.path if p)
        try:
            self._child = subprocess.Popen([sys.executable, "-m", "atlas_lightning.callbacks.drawing"],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           env={**os.environ, "PYTHONPATH": path})
        except OSError as err:
            self._give_up("start", err)

    def submit(self, step: int, history: Sequence[Mapping], partition: str, folder: Path, dpi: int) -> None:
        """Start drawing ``partition``'s figures of ``history`` into ``folder``; the previous
        drawing must have been waited for."""
        if self._pending is not None:
            raise RuntimeError(f"BackgroundDrawing: step {self._pending[0]}'s figures are still pending")
        args = (list(history), partition, Path(folder), dpi)
        self.start()
        if self._child is not None:
            try:
                pickle.dump(args, self._child.stdin)
                self._child.stdin.flush()
            except OSError as err:  # the child is gone (BrokenPipeError)
                self._give_up(f"step {step}", err)
        self._pending = (step, args)

    def wait(self) -> Optional[tuple[int, list[Path]]]:
        """The pending drawing's ``(step, paths)`` once written (None when nothing is pending)."""
        if self._pending is None:
            return None
        (step, args), self._pending = self._pending, None
        if self._child is None:
            return step, draw_partition(*args)
        try:
            status, value = pickle.load(self._child.stdout)
        except (EOFError, OSError, pickle.UnpicklingError) as err:
            self._give_up(f"step {step}", err)
            return step, draw_partition(*args)
        if status == "error":
            raise value
        return step, value

    def close(self) -> None:
        """End the child, after the pending drawing if any (``wait`` first to have its result)."""
        self._pending = None
        child, self._child = self._child, None
        if child is not None:
            child.stdin.close()  # the child's loop ends at the end of its input
            try:
                child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            child.stdout.close()

    def _give_up(self, what: str, err: BaseException) -> None:
        log.warning("the figures' drawing process is gone (%s: %s: %s); the figures are drawn in the run's own "
                    "process from now on", what, type(err).__name__, err)
        self._broken = True
        child, self._child = self._child, None
        if child is not None:
            child.kill()
            child.wait()


def serve(requests, answers) -> None:
    """The child's loop: draw each request read from ``requests``, answer on ``answers``, until
    ``requests`` ends."""
    while True:
        try:
            history, partition, folder, dpi = pickle.load(requests)
        except EOFError:
            return
        try:
            answer = ("ok", draw_partition(history, partition, folder, dpi))
        except Exception as err:  # the run re-raises it where it waits
            answer = ("error", err)
        try:
            payload = pickle.dumps(answer)
        except Exception:  # an exception that does not pickle: its words do
            payload = pickle.dumps(("error", RuntimeError(f"{type(answer[1]).__name__}: {answer[1]}")))
        answers.write(payload)
        answers.flush()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever else writes to stdout here goes to stderr, not into the answers
    serve(sys.stdin.buffer, answers)
