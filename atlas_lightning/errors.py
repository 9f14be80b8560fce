"""The error kinds every floor may raise: ``InputError`` and ``NonFiniteError``.

A config value, a question file, an adapter or a checkpoint folder that cannot be used is an
``InputError`` (``config.ConfigError``, ``questions.rows.DataError``, ``models.adapters.AdapterError``,
``store.checkpoints.CheckpointError``) whose message names what is wrong and where; the CLI
exits 2 with it. A NaN or inf that training must not go on with is a ``NonFiniteError``: the
NaN guard raises it for a non-finite step (``callbacks/nan_guard.py``), the weight sync for an
engine whose probe log-probs are not finite (``rollout/sync.py``). This module imports nothing
of the package, so every floor may import it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence


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
