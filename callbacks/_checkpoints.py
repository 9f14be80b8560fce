"""The latest complete checkpoint folder of a run before a given step:
``checkpoints/<name>/global_step_M/`` with ``M < N``.

A ``global_step_M`` folder may exist without being a checkpoint: validation writes
``global_step_N/val_dumps/N.jsonl`` for every validated step (step 0 included), and a crash can
stop a checkpoint half-way. Completeness is the checkpoint callback's rule
(``callbacks/checkpoint.py``: its ``checkpoint.json`` marker, written last); this module only
adds the "before step N" choice the NaN guard needs (a run resumed from an early step may still
hold later folders of its first attempt).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from atlas_lightning.callbacks.checkpoint import is_complete

_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def checkpoint_step(folder: Path) -> Optional[int]:
    """``M`` for a folder named ``global_step_M``, else None."""
    match = _STEP_DIR.match(Path(folder).name)
    return int(match.group(1)) if match else None


def is_complete_checkpoint(folder: str | Path) -> bool:
    """True for a ``global_step_M`` folder that the checkpoint callback finished."""
    folder = Path(folder)
    return checkpoint_step(folder) is not None and folder.is_dir() and is_complete(folder)


def latest_complete_checkpoint(checkpoints: str | Path, before_step: Optional[int] = None) -> Optional[Path]:
    """The complete ``global_step_M`` under ``checkpoints`` with the largest ``M`` (``M <
    before_step`` when given), or None."""
    checkpoints = Path(checkpoints)
    if not checkpoints.is_dir():
        return None
    best: Optional[tuple[int, Path]] = None
    for folder in checkpoints.iterdir():
        step = checkpoint_step(folder)
        if step is None or (before_step is not None and step >= before_step):
            continue
        if is_complete_checkpoint(folder) and (best is None or step > best[0]):
            best = (step, folder)
    return None if best is None else best[1]
