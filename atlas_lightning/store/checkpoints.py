"""The checkpoint folders of a run: ``checkpoints/<name>/global_step_N/`` (README, "On-disk layout").

A checkpoint folder holds ``actor/lora_adapter/`` and ``critic/lora_adapter/`` (PEFT folders),
``lightning/`` (Lightning's resumable state) and, once everything else is in place,
``checkpoint.json`` (``MARKER``: step, files, sizes, sha256). A ``global_step_N`` folder
without the marker is not a checkpoint: validation writes ``global_step_N/val_dumps/N.jsonl``
for every validated step (step 0 included), and a crash can stop a checkpoint half-way.
``latest_checkpointed_iteration.txt`` (``LATEST``, verl's file) names the newest complete one.

Who calls it: the step checkpoint callback (writes), the NaN guard (the latest complete
checkpoint before a step), the run wiring (``trainer.resume``) and ``PPOModule``'s restore.
Nothing here imports torch or Lightning.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Optional

MARKER = "checkpoint.json"
LATEST = "latest_checkpointed_iteration.txt"
STATE_DIR = "lightning"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def step_dir(checkpoints: Path, step: int) -> Path:
    """``checkpoints/global_step_<step>``."""
    return Path(checkpoints) / f"global_step_{step}"


def checkpoint_step(folder: Path) -> Optional[int]:
    """``M`` for a folder named ``global_step_M``, else None."""
    match = _STEP_DIR.match(Path(folder).name)
    return int(match.group(1)) if match else None


def is_complete(folder: str | Path) -> bool:
    """True for a ``global_step_M`` folder that the checkpoint callback finished (marker written last)."""
    folder = Path(folder)
    return checkpoint_step(folder) is not None and (folder / MARKER).is_file()


def latest_complete(checkpoints: str | Path, before_step: Optional[int] = None) -> Optional[Path]:
    """The complete ``global_step_M`` under ``checkpoints`` with the largest ``M`` (``M <
    before_step`` when given: a run resumed from an early step may still hold later folders of
    its first attempt), or None."""
    checkpoints = Path(checkpoints)
    if not checkpoints.is_dir():
        return None
    best: Optional[tuple[int, Path]] = None
    for folder in checkpoints.iterdir():
        step = checkpoint_step(folder)
        if step is None or (before_step is not None and step >= before_step):
            continue
        if folder.is_dir() and is_complete(folder) and (best is None or step > best[0]):
            best = (step, folder)
    return None if best is None else best[1]


def lightning_state_path(folder: str | Path) -> Path:
    """What ``trainer.fit(ckpt_path=...)`` takes for a checkpoint folder: ``lightning/state.ckpt``
    (one process) or the ``lightning/`` folder (a torch.distributed checkpoint under FSDP2)."""
    state = Path(folder) / STATE_DIR
    single = state / "state.ckpt"
    return single if single.is_file() else state


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
