"""The trajectories in flight, kept by a step checkpoint: ``global_step_N/inflight/`` (partial rollouts).

With scheduling by trajectory (``trajectory_producer.py``) the steps after N are under way when
step N is checkpointed. ``capture(datamodule)`` takes them at a consistent cut: it holds the
engine through ``SyncPause.hold`` (the agent loop interrupts its requests, keeping every token
they streamed, and waits), copies every opened, not yet trained step with all its trajectories
(done or open: tokens, mask, log-probs, per-token versions, open turn and segment, attempt, the
runtime's ``Episode`` with its event log, which no model output ever executes) and lets go.
Each rank's copy is gathered to rank 0, which alone writes them, ``rank_<r>.pkl`` each
(``FILE_PATTERN``), inside the checkpoint's staging folder: they move into place with the other
parts and ``checkpoint.json`` lists them with their sizes and sha256s (``store/checkpoints.py``,
``OPTIONAL_PARTS``), so a folder is a checkpoint with them or not at all.

``restore(folder)`` reads them back (every rank reads every file: a trajectory is matched by its
step, uid and session when its step opens, whatever the number of training ranks); the producer
then continues them: finished ones are handed over as saved, open ones resume by re-prefill under
the restored weights, their tokens keeping the versions that sampled them. The data cursor stays
the next step to train, so no prompt is skipped or sampled twice, and no saved token is
generated again.

The files are pickles of this package's own classes, read only from a checkpoint this run's
``checkpoint.json`` verified (as Lightning's own state is).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Optional

from atlas_lightning import distributed as dist_utils
from atlas_lightning.rollout.trajectory_producer import OpenStep

#: The folder inside ``global_step_N`` (``store.checkpoints.INFLIGHT`` names the same part).
FOLDER = "inflight"
FILE_PATTERN = "rank_{rank}.pkl"
#: The layout of a file's content; a file of another version is refused.
FORMAT = 1


def capture(datamodule) -> Optional[dict[str, bytes]]:
    """Every rank's steps in flight, as ``{file name: bytes}`` on rank 0 (``{}`` elsewhere); None
    when the datamodule schedules no trajectories (partial rollouts off, or no producer).
    Collective."""
    producer = getattr(datamodule, "producer", None)
    if not getattr(datamodule, "partial_rollouts", False) or not hasattr(producer, "snapshot"):
        return None
    with datamodule.pause.hold():  # the cut: no token moves while the copy is taken
        steps = producer.snapshot()
        payload = pickle.dumps({"format": FORMAT, "rank": dist_utils.rank(), "steps": [
            {"step": o.step, "version": o.version, "trajectories": o.trajectories} for o in steps]},
            protocol=pickle.HIGHEST_PROTOCOL)
    gathered = dist_utils.gather_objects(payload)
    if gathered is None:
        return {}
    return {FILE_PATTERN.format(rank=rank): data for rank, data in enumerate(gathered)}


def write(files: dict[str, bytes], folder: Path) -> None:
    """``files`` under ``folder/inflight/`` (the checkpoint's staging folder; rank 0)."""
    target = Path(folder) / FOLDER
    target.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (target / name).write_bytes(data)


def restore(checkpoint: Optional[Path]) -> dict[int, OpenStep]:
    """The steps in flight that ``checkpoint`` (a verified ``global_step_N``) kept, every rank's
    trajectories merged by step; ``{}`` without them."""
    folder = Path(checkpoint) / FOLDER if checkpoint is not None else None
    if folder is None or not folder.is_dir():
        return {}
    steps: dict[int, OpenStep] = {}
    for path in sorted(folder.glob("rank_*.pkl")):
        content = pickle.loads(path.read_bytes())
        if not isinstance(content, dict) or content.get("format") != FORMAT:
            raise ValueError(f"{path}: not an in-flight file of format {FORMAT}")
        for entry in content["steps"]:
            opened = steps.setdefault(entry["step"], OpenStep(entry["step"], [], entry["version"]))
            opened.trajectories.extend(entry["trajectories"])
            if entry["version"] is not None and (opened.version is None or entry["version"] < opened.version):
                opened.version = entry["version"]
    return steps


def saved_tokens(steps: dict[int, OpenStep]) -> int:
    """Generated tokens the saved trajectories hold (what a lossless resume never generates again)."""
    return sum(sum(t.response_mask) for opened in steps.values() for t in opened.trajectories)
