"""The checkpoint folders of a run: ``checkpoints/<name>/global_step_N/`` (README, "On-disk layout").

A checkpoint folder holds ``actor/lora_adapter/`` and ``critic/lora_adapter/`` (PEFT folders),
``lightning/`` (Lightning's resumable state) and, once everything else is in place,
``checkpoint.json`` (``MARKER``: step, files, sizes, sha256). A ``global_step_N`` folder
without the marker is not a checkpoint: validation writes ``global_step_N/val_dumps/N.jsonl``
for every validated step (step 0 included), and a crash can stop a checkpoint half-way.
``latest_checkpointed_iteration.txt`` (``LATEST``, verl's file) names the newest complete one.

Before a checkpoint is used (``trainer.resume``, ``trainer.init_from``, the NaN guard's
rollback) it is verified against its own marker (``verify_checkpoint``): the marker is
readable and names this folder's step, every file it lists is there with its size and sha256,
and no file it does not list sits beside them (``CheckpointError`` naming the folder and the
file otherwise). Hashing reads every byte once, in parallel over files (up to 8 threads):
about 12.5 GB for the 27B's two adapters and Lightning state; sha256 ran at 1.26 GB/s a thread
and 15.4 GB/s on 16 threads on the H200 machine (``bench/results/digest-cost-h200.json``), so a
second or two beside the disk's read, once per launch (every rank verifies: they must agree
on the folder without a process group yet).

Who calls it: the step checkpoint callback (writes), the NaN guard (the latest verified
checkpoint before a step), the run wiring (``trainer.resume``, ``trainer.init_from``) and
``PPOModule``'s restore. Nothing here imports torch or Lightning.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

from atlas_lightning.errors import InputError
from atlas_lightning.store.atomic import atomic_write_text
from atlas_lightning.store.files import read_json_object, sha256_file

MARKER = "checkpoint.json"
LATEST = "latest_checkpointed_iteration.txt"
STATE_DIR = "lightning"
#: The parts a checkpoint folder's marker covers (``val_dumps/`` is validation's, not the checkpoint's).
PARTS = ("actor", "critic", STATE_DIR)
#: Parts a checkpoint holds only in some runs, covered by the marker when present: ``inflight/``,
#: the trajectories sampled but not yet trained (partial rollouts, ``rollout/inflight.py``).
OPTIONAL_PARTS = ("inflight",)
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


class CheckpointError(InputError):
    """A checkpoint folder that does not verify; the message names the folder and the file."""


def step_dir(checkpoints: Path, step: int) -> Path:
    """``checkpoints/global_step_<step>``."""
    return Path(checkpoints) / f"global_step_{step}"


def checkpoint_step(folder: str | Path) -> Optional[int]:
    """``M`` for a folder named ``global_step_M``, else None: the one parser of the name."""
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
    (one process) or the ``lightning/`` folder (a torch.distributed checkpoint under FSDP2). A run
    restores only the format its own strategy writes (``run/resume_state.StateLayout``)."""
    state = Path(folder) / STATE_DIR
    single = state / "state.ckpt"
    return single if single.is_file() else state


def write_marker(folder: str | Path, step: int) -> dict:
    """Write ``folder/checkpoint.json`` last, atomically: the step and, for every file under
    ``PARTS``, its size and sha256 (what ``verify_checkpoint`` checks). Returns the marker."""
    folder = Path(folder)
    paths = sorted(p for part in PARTS + OPTIONAL_PARTS for p in (folder / part).rglob("*") if p.is_file())
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1, len(paths)))) as pool:
        digests = list(pool.map(sha256_file, paths))
    files = {str(p.relative_to(folder)).replace(os.sep, "/"): {"bytes": p.stat().st_size, "sha256": digest}
             for p, digest in zip(paths, digests)}
    marker = {"global_step": step, "files": files}
    atomic_write_text(folder / MARKER, json.dumps(marker, indent=1) + "\n")
    return marker


def _marker(folder: Path) -> dict:
    path = folder / MARKER
    if not path.is_file():
        raise CheckpointError(f"{folder}: no {MARKER} (not a complete checkpoint: the save did not finish)")
    marker = read_json_object(path, CheckpointError, folder)
    files = marker.get("files")
    if not isinstance(files, dict) or not files or not all(
            isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("sha256"), str)
            for v in files.values()):
        raise CheckpointError(f"{folder}: {MARKER} is damaged (its 'files' must map each file to bytes and sha256)")
    for rel in files:
        if rel.startswith("/") or ".." in rel.split("/") or "\\" in rel:
            raise CheckpointError(f"{folder}: {MARKER} lists {rel!r}, which is not a path inside the folder")
    step = checkpoint_step(folder)
    if marker.get("global_step") != step:
        raise CheckpointError(f"{folder}: {MARKER} says global_step={marker.get('global_step')!r}, "
                              f"the folder is step {step}")
    return marker


def verify_checkpoint(folder: str | Path, *, parts: Sequence[str] = PARTS, hashes: bool = True) -> dict:
    """The marker of ``folder`` once every file it lists under ``parts`` is present with its size
    and (``hashes``) its sha256, and no unlisted file lies under ``parts``; ``CheckpointError``
    naming the folder and the first file that fails otherwise. ``parts``: e.g. ``("actor",)`` for
    ``trainer.init_from`` with the actor alone."""
    folder = Path(folder)
    if checkpoint_step(folder) is None or not folder.is_dir():
        raise CheckpointError(f"{folder}: not a global_step_N checkpoint folder")
    marker = _marker(folder)
    required = tuple(parts)
    if required == PARTS:  # the whole checkpoint: its optional parts too, where it has them
        parts = PARTS + OPTIONAL_PARTS
    listed = {rel: entry for rel, entry in marker["files"].items() if rel.split("/", 1)[0] in parts}
    for part in required:
        if not any(rel.startswith(part + "/") for rel in listed):
            raise CheckpointError(f"{folder}: {MARKER} lists no file under {part}/")
    present = {str(p.relative_to(folder)).replace(os.sep, "/") for part in parts
               for p in (folder / part).rglob("*") if p.is_file()}
    for rel in sorted(present - set(listed)):
        raise CheckpointError(f"{folder}: {rel} is not listed in {MARKER} (a checkpoint holds only what it lists)")
    for rel, entry in sorted(listed.items()):
        path = folder / rel
        if not path.is_file():
            raise CheckpointError(f"{folder}: {rel} is missing ({MARKER} lists it)")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"{folder}: {rel} has {size} bytes, {MARKER} says {entry['bytes']} "
                                  f"(truncated or replaced)")
    if hashes:
        names = sorted(listed)
        with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1, len(names)))) as pool:
            digests = list(pool.map(lambda rel: sha256_file(folder / rel), names))
        for rel, digest in zip(names, digests):
            if digest != listed[rel]["sha256"]:
                raise CheckpointError(f"{folder}: {rel} does not match its sha256 in {MARKER} (damaged)")
    return marker


def latest_verified(checkpoints: str | Path, before_step: Optional[int] = None, *,
                    hashes: bool = True) -> tuple[Optional[Path], list[str]]:
    """``(folder, refusals)``: the ``global_step_M`` under ``checkpoints`` with the largest ``M``
    (``< before_step`` when given) that verifies (``verify_checkpoint``), and one line for each
    newer folder holding a marker that did not, naming it and why (for the log)."""
    checkpoints = Path(checkpoints)
    if not checkpoints.is_dir():
        return None, []
    steps = sorted(((checkpoint_step(f), f) for f in checkpoints.iterdir()
                    if checkpoint_step(f) is not None and f.is_dir()), reverse=True)
    refusals: list[str] = []
    for step, folder in steps:
        if (before_step is not None and step >= before_step) or not (folder / MARKER).exists():
            continue
        try:
            verify_checkpoint(folder, hashes=hashes)
        except CheckpointError as err:
            refusals.append(str(err))
            continue
        return folder, refusals
    return None, refusals
