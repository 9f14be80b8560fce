"""The error kinds every floor may raise: ``InputError``, ``NonFiniteError``, ``CheckpointWriteError``
and ``RunStopped``.

A config value, a question file, an adapter or a checkpoint folder that cannot be used is an
``InputError`` (``config.ConfigError``, ``questions.rows.DataError``, ``models.adapters.AdapterError``,
``store.checkpoints.CheckpointError``) whose message names what is wrong and where; the CLI
exits 2 with it. A NaN or inf that training must not go on with is a ``NonFiniteError``: the
NaN guard raises it for a non-finite step (``callbacks/nan_guard.py``), the weight sync for an
engine whose probe log-probs are not finite (``rollout/sync.py``). A checkpoint whose files could
not be written (the disk full, a write refused) is a ``CheckpointWriteError`` (raised on every
rank by ``callbacks/checkpoint.py``). A fault that stops a run part-way (the engine died, the
card ran out of memory, a non-finite step, a file that could not be written) reaches the user as a
``RunStopped`` (``run/faults.py``): the cause, the step, and the last complete checkpoint to
resume from; the CLI exits with its ``exit_code`` (``STOP_EXIT_CODES``). This module imports
nothing of the package, so every floor may import it.

Exit codes of the CLI: 0 done; 1 ``publish`` could not finish (the Hub unreachable or failing: the same
command again later sends only what is missing); 2 an input that cannot be used (nothing was written); 3 not
available yet; 4 the rollout engine died or does not serve what it was sent; 5 out of memory;
6 a non-finite step; 7 a checkpoint or another file of the run could not be written (the disk
full); 8 the user's own code (a reward scorer, a callback) raised part-way; 130 SIGINT (Ctrl-C),
143 SIGTERM (the shell's 128 + the signal). After 4 to 8, 130 and 143 the run's last complete
checkpoint is intact and ``trainer.resume=auto`` continues from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence


def first_line(err: BaseException, limit: int = 300) -> str:
    """A library's error ``err`` as one line of a refusal: its message with its line breaks
    folded (transformers' validation errors put the field's problem on the lines after the
    first), cut at ``limit`` characters; its type's name when it has no message."""
    return " ".join(str(err).split())[:limit] or type(err).__name__


#: The most characters of another system's own text (a server's reply, the Hub's message) a
#: message quotes: its first words say what went wrong; the rest stays in that system's log.
QUOTED_CHARS = 120


def quoted(text: str, limit: int = QUOTED_CHARS) -> str:
    """``text`` (another system's own words) on one line, cut at ``limit`` characters with the
    number left out said."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else f"{flat[:limit]}... ({len(flat) - limit} more characters)"


class InputError(ValueError):
    """Something the user named that cannot be used (a config value, a question file, an adapter
    or checkpoint folder); the message names it and what is wrong. The CLI exits 2 with it."""


class NonFiniteError(RuntimeError):
    """Training met a NaN/inf it must not go on with. ``step``: the RL step; ``what``: the
    quantities; ``last_good_checkpoint``: the folder to resume from (None if there is none);
    ``diagnostic``: the written ``nonfinite/step_N.json`` (None if not written)."""

    def __init__(self, message: str, *, step: int, what: Sequence[str] = (),
                 last_good_checkpoint: Optional[Path] = None, diagnostic: Optional[Path] = None) -> None:
        super().__init__(message)
        self.step = step
        self.what = list(what)
        self.last_good_checkpoint = last_good_checkpoint
        self.diagnostic = diagnostic


#: ``RunStopped.cause`` -> the CLI's exit code (module doc).
STOP_EXIT_CODES = {"engine": 4, "out_of_memory": 5, "non_finite": 6, "write": 7, "user_code": 8,
                   "interrupted": 130, "terminated": 143}


class CheckpointWriteError(RuntimeError):
    """A checkpoint's files could not be written (in the background or inline); the folder has no marker."""


class RunStopped(RuntimeError):
    """A run stopped on a fault part-way (module doc). ``cause``: a key of ``STOP_EXIT_CODES``;
    the message names the cause, the last step trained and the checkpoint to resume from
    (``last_good_checkpoint``, None when there is none)."""

    def __init__(self, message: str, *, cause: str, last_good_checkpoint: Optional[Path] = None) -> None:
        if cause not in STOP_EXIT_CODES:
            raise ValueError(f"RunStopped: cause must be one of {', '.join(STOP_EXIT_CODES)}, got {cause!r}")
        super().__init__(message)
        self.cause = cause
        self.last_good_checkpoint = last_good_checkpoint

    @property
    def exit_code(self) -> int:
        return STOP_EXIT_CODES[self.cause]
