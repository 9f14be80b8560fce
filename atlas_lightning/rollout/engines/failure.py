"""An engine that failed, named once: every call into an engine's backend becomes ``EngineError``.

A vLLM engine that dies (its engine core shut down or crashed, a worker's device lost) does not
say so in its own words: the next call into it raises whatever its internals meet first, an
``AssertionError`` from a process group that is gone, an ``AttributeError`` on a model that was
released, a ``RuntimeError`` from the device, vLLM's ``EngineDeadError``. ``FailureGuard`` is
what an engine wraps around each of its backend calls (``with guard.call("set_adapter"):``):

* an exception from the backend becomes ``EngineError`` naming the engine, the operation and
  the backend's error (the clean stop of ``run/faults.py`` then applies: exit 4), and the engine
  is failed from then on: every later call raises ``EngineError`` at once, naming the first
  failure (a failed engine is never trusted again);
* ``EngineError`` the engine raised itself passes unchanged (already named), and so does an
  exception that came from the caller's side of the call: a weights iterator the trainer hands
  the engine (``guard.passing(weights)``) that raised inside the backend, e.g. an FSDP gather;
* ``torch.OutOfMemoryError`` passes unchanged (the out-of-memory stop, exit 5, names it better),
  the engine failed all the same.

``close`` of a failed engine must not raise over the fault being reported (``closing``).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterable, Iterator, Optional, TypeVar

import torch

from atlas_lightning.rollout.engine import EngineError

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The attribute ``passing`` sets on an exception raised by the caller's iterator.
_CALLER_SIDE = "_atlas_raised_by_caller"


class FailureGuard:
    """The failure state of one engine named ``engine`` (module doc)."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        #: The first failure (``"<operation>: <Type>: <message>"``), None while the engine works.
        self.failed: Optional[str] = None

    @contextmanager
    def call(self, operation: str) -> Iterator[None]:
        """Run the body, a call into the backend for ``operation`` (module doc)."""
        if self.failed is not None:
            raise EngineError(f"{self.engine} engine failed earlier ({self.failed}); {operation} not attempted")
        try:
            yield
        except EngineError:
            raise
        except Exception as err:
            caller = _caller_side(err)
            if caller is not None:
                raise caller
            self.failed = f"{operation}: {type(err).__name__}: {' '.join(str(err).split())}"
            if isinstance(err, torch.OutOfMemoryError):
                raise
            raise EngineError(f"{self.engine} engine failed during {self.failed}") from err

    def passing(self, items: Iterable[T]) -> Iterator[T]:
        """``items`` as they are; an exception they raise is the caller's, passed on unchanged."""
        try:
            yield from items
        except Exception as err:
            setattr(err, _CALLER_SIDE, True)
            raise

    @contextmanager
    def closing(self) -> Iterator[None]:
        """Around ``close``: a failed engine's shutdown error is logged, not raised (the run is
        already stopping on the first failure); a working engine's is raised."""
        try:
            yield
        except Exception as err:
            if self.failed is None:
                raise
            log.warning("%s engine (failed during %s) did not close cleanly: %s: %s", self.engine, self.failed,
                        type(err).__name__, err)


def _caller_side(err: BaseException) -> Optional[BaseException]:
    """The exception ``passing`` marked, ``err`` itself or one it was raised from, if any."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if getattr(err, _CALLER_SIDE, False):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None
