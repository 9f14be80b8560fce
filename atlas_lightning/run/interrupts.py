"""SIGINT (Ctrl-C) and SIGTERM (a scheduler's preemption, ``kill``) as a clean stop that names the signal.

Inside ``Trainer.fit``'s loop Lightning handles both: SIGTERM is noted by its own handler and
the loop stops at the end of the step under way (``SIGTERMException``; the step checkpoint, if
that step saves one, is written first); SIGINT raises ``KeyboardInterrupt`` where the main thread
is, and Lightning runs the callbacks' ``on_exception`` (a checkpoint write in flight finishes)
before it exits with ``SystemExit(1)``. Outside that loop (the config checks, the models
loading, the engine starting, Lightning's setup, the closing summary) Python's defaults would
apply: SIGTERM kills the process without a word. ``terminable`` installs, for a command's
whole life, a SIGTERM handler that raises ``Terminated`` wherever the main thread is, unless
Lightning's handler is in place (it calls this one too: it then only notes the signal).

``signal_of`` tells which signal ended a run from the exception that ended it, so that
``run/faults.py`` stops with ``RunStopped`` (exit 130 for SIGINT, 143 for SIGTERM: the shell's
128 + the signal's number) naming the signal, the last RL step and the checkpoint to resume from.
"""

from __future__ import annotations

import signal
import threading
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
    own handler is installed (module doc). Outside the main thread (no handler can be set there)
    the body runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigterm(signum, frame) -> None:
        if signal.getsignal(signal.SIGTERM) is on_sigterm:  # not called through Lightning's handler
            raise Terminated()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def signal_of(err: BaseException) -> Optional[str]:
    """``"SIGINT"`` or ``"SIGTERM"`` when ``err`` is how that signal ended a run (module doc):
    ``KeyboardInterrupt``, Lightning's ``SystemExit`` after one, its ``SIGTERMException`` or
    ``Terminated``; None for anything else (a ``SystemExit`` of another origin included)."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    if isinstance(err, (Terminated, SIGTERMException)):
        return "SIGTERM"
    if isinstance(err, KeyboardInterrupt):
        return "SIGINT"
    if isinstance(err, SystemExit) and isinstance(err.__context__, KeyboardInterrupt):  # Lightning's exit after one
        return "SIGINT"
    return None
