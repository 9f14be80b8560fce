"""A step folder of trajectory records (README, "On-disk layout"), gathered from every rank, written whole.

``artifacts/<name>/{train,val}/step_N/`` (and ``nonfinite/step_N/``) hold one record a
trajectory (``records.write_record``), ``tensors.npz`` (``records.write_step_tensors``: the
records' per-token arrays plus the caller's, e.g. values, returns, advantages) and
``manifest.json`` (``records.write_manifest``).

Visibility: the folder is written as ``<parent>/.tmp-step_N-<random>/`` and renamed to
``step_N`` only once complete, so a reader (or a crash) never leaves a half-written ``step_N``;
the hidden temporary folder of a crashed run is removed by ``remove_stale_temporaries``. A
``step_N`` that already exists (a step run again after a resume) is moved aside, replaced, then
deleted: for that instant no ``step_N`` exists, but never a partial one.

Who calls it: the artifact dump, validation and NaN-guard callbacks. ``gather_step`` is a
collective (every rank calls it); ``write_step_folder`` runs on rank 0 only.
"""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from atlas_lightning import distributed
from atlas_lightning.store.records import TrajectoryRecord, write_manifest, write_record, write_step_tensors
from atlas_lightning.store.files import fsync_folder

_TEMP_PREFIX = ".tmp-step_"
_OLD_PREFIX = ".old-step_"


def check_tensors(step: int, records: Sequence[TrajectoryRecord], tensors: Mapping[str, Sequence]) -> dict:
    """``tensors`` as ``{name: [1-D float32 array per record]}``, checked against the records:
    one array a trajectory, each as long as its ``response_ids``. ``ValueError`` naming the step,
    the array and the trajectory otherwise."""
    checked = {}
    for name, arrays in tensors.items():
        if len(arrays) != len(records):
            raise ValueError(f"step {step}: tensors[{name!r}] has {len(arrays)} arrays for {len(records)} trajectories")
        out = []
        for record, array in zip(records, arrays):
            array = np.asarray(array.detach().cpu() if hasattr(array, "detach") else array, dtype=np.float32)
            expected = None if record.response_ids is None else len(record.response_ids)
            if array.ndim != 1 or (expected is not None and len(array) != expected):
                raise ValueError(
                    f"step {step}: tensors[{name!r}] of trajectory {record.uid}/{record.session_id} has shape "
                    f"{array.shape}; expected ({expected},), its response length"
                )
            out.append(array)
        checked[name] = out
    return checked


def gather_step(step: int, records: Sequence[TrajectoryRecord], tensors: Optional[Mapping[str, Sequence]] = None,
                extra: Any = None) -> Optional[tuple[list[TrajectoryRecord], dict[str, list], list]]:
    """Collective: every rank's records (and per-trajectory tensors, and an ``extra`` object) on
    rank 0, concatenated in rank order: ``(records, tensors, [extra of each rank])``; ``None`` on
    other ranks. Refuses two trajectories with the same file name (one would overwrite the other)
    and ranks that disagree on the tensor names."""
    local = (list(records), check_tensors(step, records, tensors or {}), extra)
    gathered = distributed.gather_objects(local)
    if gathered is None:
        return None
    all_records: list[TrajectoryRecord] = []
    all_tensors: dict[str, list] = {name: [] for name in local[1]}
    extras = []
    for rank, (rank_records, rank_tensors, rank_extra) in enumerate(gathered):
        if set(rank_tensors) != set(all_tensors):
            raise ValueError(
                f"step {step}: rank {rank} sent tensors {sorted(rank_tensors)}, rank 0 sent {sorted(all_tensors)}"
            )
        all_records.extend(rank_records)
        for name, arrays in rank_tensors.items():
            all_tensors[name].extend(arrays)
        extras.append(rank_extra)
    seen: dict[str, int] = {}
    for record in all_records:
        if record.filename in seen:
            raise ValueError(
                f"step {step}: two trajectories are named {record.filename} (uid and session_id must be unique)")
        seen[record.filename] = 1
    return all_records, all_tensors, extras


def write_step_folder(parent: str | Path, step: int, records: Sequence[TrajectoryRecord],
                      tensors: Optional[Mapping[str, Sequence[np.ndarray]]] = None,
                      manifest_extra: Optional[Mapping[str, Any]] = None) -> Path:
    """Write ``<parent>/step_<step>/`` (records, tensors.npz, manifest.json) so that it appears
    only when complete; returns its path. Rank 0 only."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    final = parent / f"step_{int(step)}"
    temp = parent / f"{_TEMP_PREFIX}{int(step)}-{secrets.token_hex(4)}"
    temp.mkdir()
    try:
        for record in records:
            write_record(temp, record)
        write_step_tensors(temp, records, tensors)
        extra = {"step": int(step), "tensor_names": sorted(tensors or {})}
        extra.update(manifest_extra or {})
        write_manifest(temp, extra=extra)
        _move_into_place(temp, final)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return final


def _move_into_place(temp: Path, final: Path) -> None:
    old = None
    if final.exists():
        old = final.parent / f"{_OLD_PREFIX}{final.name[len('step_'):]}-{secrets.token_hex(4)}"
        final.replace(old)
    temp.replace(final)
    fsync_folder(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def remove_stale_temporaries(parent: str | Path) -> list[Path]:
    """Delete the hidden temporary and set-aside step folders a crashed run left in ``parent``;
    returns what was removed. Rank 0, at fit start (no step is being written then)."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    removed = []
    for path in sorted(parent.iterdir()):
        if path.is_dir() and path.name.startswith((_TEMP_PREFIX, _OLD_PREFIX)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
