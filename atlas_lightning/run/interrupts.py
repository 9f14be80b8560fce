"""SIGINT (Ctrl-C) and SIGTERM (a scheduler's preemption, ``kill``) as a clean stop that names the signal.

Inside ``Trainer.fit``'s loop Lightning handles both: SIGTERM is noted by its own handler and
the loop stops at the end of the step under way (``SIGTERMException``; the step checkpoint, if
that step saves one, is written first; before the first step, once a validation there is done:
``callbacks/validation.py``); SIGINT raises ``KeyboardInterrupt`` where the main thread is, and
Lightning runs the callbacks' ``on_exception`` (a checkpoint write in flight finishes) before it
exits with ``SystemExit(1)``. Outside that loop (the config checks, the models loading, the
engine starting, Lightning's setup, the closing summary) Python's defaults would apply: SIGTERM
kills the process without a word. ``terminable`` installs, for a command's whole life, a SIGTERM
handler that raises ``Terminated`` wherever the main thread is, unless Lightning's handler is in
place (it calls this one too: it then only notes the signal).

That raise can be dropped: Python cannot raise out of a weakref callback, a ``__del__`` or a
garbage collector's callback (it prints "Exception ignored in" and goes on), and a handler runs
inside whichever of them the main thread is in (the start-up's imports run importlib's
module-lock callbacks); an ``except BaseException`` that does not re-raise drops it too. So the
handler keeps the signal until a stop carries it: when its ``Terminated`` dies before the body
ends (raised, nothing holds it: no stop is under way) the signal is sent to the main thread
again, and raised again there, or noted by Lightning's handler if that is in place by then; a
body that returns with a SIGTERM still kept ends in ``Terminated``. The dropped raise prints
nothing. While a stop is under way (a ``Terminated``, ``KeyboardInterrupt`` or ``SystemExit``,
Lightning's ``SIGTERMException`` included, raised or being handled: ``on_exception`` finishing a
checkpoint write, the stop's message being written) a SIGTERM does not interrupt it; it is kept.

``signal_of`` tells which signal ended a run from the exception that ended it, so that
``run/faults.py`` stops with ``RunStopped`` (exit 130 for SIGINT, 143 for SIGTERM: the shell's
128 + the signal's number) naming the signal, the last RL step and the checkpoint to resume from.
"""

from __future__ import annotations

import queue
import signal
import sys
import threading
import weakref
from contextlib import contextmanager
from typing import Iterator, Optional

#: ``RunStopped.cause`` of each signal (``errors.STOP_EXIT_CODES``: 130 and 143).
CAUSES = {"SIGINT": "interrupted", "SIGTERM": "terminated"}
#: How each signal reads in a stop's message.
NAMES = {"SIGINT": "SIGINT (Ctrl-C)", "SIGTERM": "SIGTERM"}


class Terminated(BaseException):
    """SIGTERM arrived while no Lightning loop was handling it. A ``BaseException``, as
    ``KeyboardInterrupt`` is: no ``except Exception`` on the way swallows it."""


@contextmanager
def terminable() -> Iterator[None]:
    """While the body runs, SIGTERM raises ``Terminated`` in the main thread unless Lightning's
    own handler is installed, again each time that raise is dropped, and once more when the body
    returns with it kept (module doc). Outside the main thread (no handler can be set there) the
    body runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    kept = _Kept()

    def on_sigterm(signum, frame) -> None:
        if signal.getsignal(signal.SIGTERM) is not on_sigterm:  # called through Lightning's handler: it noted it
            kept.settle()
        elif _stop_under_way():  # kept all the same: should that stop be caught, the body's end raises
            kept.signum = signum
        else:
            raise kept.terminated(signum)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    previous_hook = sys.unraisablehook
    sys.unraisablehook = quiet_hook = _quiet_about_terminated(previous_hook)
    try:
        yield
        if kept.signum is not None:  # its raise was dropped and the body ran on to its end
            raise Terminated()
    finally:
        try:
            kept.close()  # before the handler goes: a signal sent after it would meet Python's default, death
        finally:
            if sys.unraisablehook is quiet_hook:
                sys.unraisablehook = previous_hook
            signal.signal(signal.SIGTERM, previous)


class _Kept:
    """The SIGTERM a handler raised ``Terminated`` for, until a stop carries it. A thread of its
    own sends it to the main thread again whenever the latest ``Terminated`` dies unraised;
    ``settle`` (Lightning's handler noted it) and ``close`` (the body ended) end that."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._latest: Optional[weakref.ref] = None
        self._wakes: queue.SimpleQueue = queue.SimpleQueue()  # put() is safe in a weakref callback
        self._lock = threading.Lock()  # a signal sent and the close never cross
        self._closed = False
        self._thread: Optional[threading.Thread] = None

    def terminated(self, signum: int) -> Terminated:
        """A ``Terminated`` for ``signum`` to raise, watched: its death, still kept, sends ``signum`` again."""
        err = Terminated()
        self.signum, self._latest = signum, weakref.ref(err, self._died)
        if self._thread is None:
            self._thread = threading.Thread(target=self._send_again, name="sigterm-again", daemon=True)
            self._thread.start()
        return err

    def settle(self) -> None:
        self.signum = None

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._wakes.put(None)

    def _died(self, ref: weakref.ref) -> None:
        if ref is self._latest:  # an earlier one's death says nothing: a later raise carries the signal
            self._wakes.put(ref)

    def _send_again(self) -> None:
        main = threading.main_thread().ident
        while self._wakes.get() is not None:
            with self._lock:
                if not self._closed and self.signum is not None:
                    signal.pthread_kill(main, self.signum)  # a real signal: it wakes a blocking call too


def _stop_under_way() -> bool:
    """Whether the main thread, where a handler runs, is already raising or handling an
    exception that ends the process (module doc), or one raised from such an exception."""
    err, seen = sys.exc_info()[1], set()
    while err is not None and id(err) not in seen:
        if isinstance(err, (Terminated, KeyboardInterrupt, SystemExit)):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


def _quiet_about_terminated(previous):
    """A ``sys.unraisablehook`` that drops the report of a ``Terminated`` Python could not raise
    (``terminable`` sends its signal again) and hands any other report to ``previous``."""
    def quiet_hook(unraisable) -> None:
        if not isinstance(unraisable.exc_value, Terminated):
            previous(unraisable)
    return quiet_hook


def signal_of(err: BaseException) -> Optional[str]:
    """``"SIGINT"`` or ``"SIGTERM"`` when ``err`` is how that signal ended a run (module doc):
    ``KeyboardInterrupt``, Lightning's ``SystemExit`` after one, its ``SIGTERMException`` or
    ``Terminated``; None for anything else (a ``SystemExit`` of another origin included)."""
    # Lightning not imported: no SIGTERMException exists (importing it, and torch, would take
    # seconds of a scheduler's grace period at a stop during the start-up)
    lightning = sys.modules.get("lightning.pytorch.utilities.exceptions")
    if isinstance(err, Terminated) or (lightning is not None and isinstance(err, lightning.SIGTERMException)):
        return "SIGTERM"
    if isinstance(err, KeyboardInterrupt):
        return "SIGINT"
    if isinstance(err, SystemExit) and isinstance(err.__context__, KeyboardInterrupt):  # Lightning's exit after one
        return "SIGINT"
    return None
