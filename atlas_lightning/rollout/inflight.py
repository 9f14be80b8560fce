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

The files are pickles of this package's own data classes, read only from a checkpoint this
run's ``checkpoint.json`` verified (as Lightning's own state is), and read by an unpickler that
builds nothing else (``_DataUnpickler``: Python's containers, numpy's scalars and arrays, and the
classes a trajectory holds; a file naming any other callable is refused, so that no file, even
one whose marker was rewritten, runs code). ``restore`` checks what it read: each file is
``rank_<r>.pkl`` holding rank ``r``'s steps after the checkpoint's, each trajectory's token
arrays of one length, its log-probs finite (``InflightError``, an ``InputError`` naming the file;
``run/facts.py`` reads them so before anything is written). ``check_continued`` refuses kept
steps whose trajectories are not the ones this run samples (``run/facts.py`` calls it too, with
the steps ``rollout/step_questions.py`` says the run samples, before anything is written).
"""

from __future__ import annotations

import io
import math
import pickle
import re
from pathlib import Path
from typing import Any, Callable, Optional

from atlas_lightning import distributed as dist_utils
from atlas_lightning.errors import InputError, quoted
from atlas_lightning.rollout.agent_loop import Trajectory
from atlas_lightning.rollout.trajectory_producer import OpenStep
from atlas_lightning.store.checkpoints import checkpoint_step

#: The folder inside ``global_step_N`` (``store.checkpoints.INFLIGHT`` names the same part).
FOLDER = "inflight"
FILE_PATTERN = "rank_{rank}.pkl"
#: The layout of a file's content; a file of another version is refused.
FORMAT = 1
_FILE_NAME = re.compile(r"^rank_(\d+)\.pkl$")


class InflightError(InputError):
    """A checkpoint's in-flight file that a resume cannot use; the message names the file."""


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
    trajectories merged by step; ``{}`` without them. ``InflightError`` naming the file when one
    is not what ``capture`` writes (module doc)."""
    folder = Path(checkpoint) / FOLDER if checkpoint is not None else None
    if folder is None or not folder.is_dir():
        return {}
    after = checkpoint_step(checkpoint)  # None for a folder named otherwise (a test's)
    steps: dict[int, OpenStep] = {}
    for path in sorted(folder.iterdir()):
        for entry in _read(path, after):
            opened = steps.setdefault(entry["step"], OpenStep(entry["step"], [], entry["version"]))
            opened.trajectories.extend(entry["trajectories"])
            if entry["version"] is not None and (opened.version is None or entry["version"] < opened.version):
                opened.version = entry["version"]
    for step, opened in steps.items():  # a trajectory is matched by (uid, session): one of each
        keys = [(t.uid, t.session_id) for t in opened.trajectories]
        if len(set(keys)) != len(keys):
            twice = sorted(k for k in set(keys) if keys.count(k) > 1)[0]
            raise InflightError(f"{folder}: step {step} keeps trajectory {twice[0]}/{twice[1]} more than once")
    return steps


def check_continued(steps: dict[int, OpenStep], sampled: Callable[[int], set[tuple[str, str]]],
                    checkpoint: Path) -> None:
    """Every kept step holds exactly the trajectories this run samples for it (``sampled(step)``:
    every rank's ``(uid, session)``), so that the producer continues each one and samples none
    anew beside it. A kept trajectory this run does not sample would be dropped, and one it
    samples but the checkpoint does not keep would be trained with a step it never belonged to:
    ``rollout.n``, ``data.*`` or ``data.seed`` changed since the checkpoint was written.
    ``InflightError`` naming the checkpoint, the step and the trajectories otherwise."""
    for step in sorted(steps):
        kept = {(t.uid, t.session_id) for t in steps[step].trajectories}
        fresh = sampled(step)
        if kept == fresh:
            continue
        dropped, new = sorted(kept - fresh), sorted(fresh - kept)
        what = []
        if dropped:
            what.append(f"keeps {len(dropped)} trajectories this run does not sample ({_keys(dropped)})")
        if new:
            what.append(f"lacks {len(new)} trajectories this run samples ({_keys(new)})")
        raise InflightError(
            f"{checkpoint}: step {step} in flight {' and '.join(what)}: rollout.n, data.* or data.seed differ from "
            f"the launch that wrote the checkpoint, and its kept trajectories would be lost; resume with that "
            f"launch's settings, or start afresh from its adapters with trainer.init_from={checkpoint} "
            f"trainer.resume=null")


def _keys(keys: list[tuple[str, str]], shown: int = 3) -> str:
    named = ", ".join(f"{uid}/{session}" for uid, session in keys[:shown])
    return named + (f", ... {len(keys) - shown} more" if len(keys) > shown else "")


def _read(path: Path, after: Optional[int]) -> list[dict]:
    """The steps of one in-flight file, checked (``restore``)."""
    match = _FILE_NAME.match(path.name)
    if match is None or not path.is_file():
        raise InflightError(f"{path}: not an in-flight file (a checkpoint's {FOLDER}/ holds rank_<r>.pkl files only)")
    try:
        content = _DataUnpickler(io.BytesIO(path.read_bytes())).load()
    except Exception as err:  # a damaged or foreign file, whatever the unpickler raises
        raise InflightError(f"{path}: cannot be read as an in-flight file "
                            f"({quoted(f'{type(err).__name__}: {err}')})") from None
    if not isinstance(content, dict) or content.get("format") != FORMAT:
        raise InflightError(f"{path}: not an in-flight file of format {FORMAT}")
    if content.get("rank") != int(match.group(1)) or not isinstance(content.get("steps"), list):
        raise InflightError(f"{path}: holds rank {content.get('rank')!r}'s steps, not those of its name's rank")
    for entry in content["steps"]:
        problem = _entry_problem(entry, after)
        if problem:
            raise InflightError(f"{path}: {problem}")
    return content["steps"]


def _entry_problem(entry: Any, after: Optional[int]) -> Optional[str]:
    """What is wrong with one saved step (None: nothing)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("trajectories"), list):
        return "a step entry is not {step, version, trajectories}"
    step, version = entry.get("step"), entry.get("version")
    if not _is_int(step) or (after is not None and step <= after):
        return f"step {step!r} is not a step after the checkpoint's ({after})"
    if version is not None and not _is_int(version):
        return f"step {step}: version {version!r} is not an int"
    for traj in entry["trajectories"]:
        problem = _trajectory_problem(traj)
        if problem:
            return f"step {step}: {problem}"
    return None


def _trajectory_problem(traj: Any) -> Optional[str]:
    if not isinstance(traj, Trajectory) or not hasattr(traj.episode, "done"):
        return f"a saved trajectory is a {type(traj).__name__}, not a Trajectory with its episode"
    name = f"trajectory {traj.uid}/{traj.session_id}"
    arrays = (traj.response_ids, traj.response_mask, traj.response_logprobs, traj.response_versions)
    if not all(isinstance(a, list) for a in arrays) or len({len(a) for a in arrays}) != 1:
        return f"{name}: its response ids, mask, log-probs and versions are not lists of one length"
    if not all(_is_int(t) and t >= 0 for t in list(traj.prompt_ids) + traj.response_ids):
        return f"{name}: a token id is not an int >= 0"
    if not all(m in (0, 1) for m in traj.response_mask):
        return f"{name}: its response mask holds a value other than 0 and 1"
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in traj.response_logprobs):
        return f"{name}: a log-prob is not a finite number"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: What an in-flight file may build besides the classes a trajectory holds (``_DataUnpickler``).
_PLAIN = {("builtins", "set"), ("builtins", "frozenset"), ("builtins", "complex"), ("collections", "OrderedDict"),
          ("collections", "deque"), ("numpy", "dtype"), ("numpy", "ndarray"),
          ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
          ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
          ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer")}
#: The modules of the classes a saved trajectory holds: itself, its episode and what the
#: episode keeps (its question, candidates, runtime settings, parsed calls: ``atlas_lightning.env.*``).
_DATA_MODULES = ("atlas_lightning.rollout.agent_loop", "atlas_lightning.questions.schema")
_DATA_PACKAGE = "atlas_lightning.env."


class _DataUnpickler(pickle.Unpickler):
    """An unpickler that builds plain data only (module doc): ``find_class`` gives out the
    callables of ``_PLAIN`` and the classes (not functions, not exceptions) defined in
    ``_DATA_MODULES`` and ``_DATA_PACKAGE``, whose construction runs no code of the file's choosing."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PLAIN:
            return super().find_class(module, name)
        if "." not in name and (module in _DATA_MODULES or module.startswith(_DATA_PACKAGE)):
            found = super().find_class(module, name)
            if isinstance(found, type) and found.__module__ == module and not issubclass(found, BaseException):
                return found
        raise pickle.UnpicklingError(f"{module}.{name} is not a class an in-flight file holds")


def saved_tokens(steps: dict[int, OpenStep]) -> int:
    """Generated tokens the saved trajectories hold (what a lossless resume never generates again)."""
    return sum(sum(t.response_mask) for opened in steps.values() for t in opened.trajectories)
