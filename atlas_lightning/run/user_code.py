"""The user's own code a fit calls, and whether an error part-way came from it.

A config may name code of the user's own: a reward scorer (``reward._target_``, the contract in
``reward/scorer.py``) and callbacks (``callbacks.<name>._target_``). When one of them raises
during a fit, or the scorer returns what breaks its contract, the run stops cleanly
(``run/faults.py``: exit 8; not 2, which says nothing was written) naming the key, the object, the
error and the user's line that raised it, with the last complete checkpoint to resume from once
it is fixed; the traceback goes to the run's log. Code of this package or of Lightning is not
the user's: an error there is a bug and keeps its traceback.
"""

from __future__ import annotations

import inspect
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

#: Packages whose code is not the user's (a ``_target_`` inside them names a class of theirs).
NOT_USER_CODE = ("atlas_lightning.", "lightning.", "pytorch_lightning.")
#: The frame through which every scorer is called: an error under it is the scorer's (its call or its output).
SCORER_CALL = ("reward/scorer.py", "score_trajectory")


@dataclass(frozen=True)
class UserCode:
    """``key`` (``reward._target_`` or ``callbacks.<name>._target_``) names ``target``, defined in
    ``file`` at ``lines`` (first, last)."""

    key: str
    target: str
    file: Optional[str]
    lines: tuple[int, int] = (0, 0)

    def raised_in(self, frame: traceback.FrameSummary) -> bool:
        """Whether ``frame`` runs this code (its file, within its lines)."""
        return self.file is not None and _same_file(frame.filename, self.file) and \
            self.lines[0] <= (frame.lineno or 0) <= self.lines[1]


@dataclass(frozen=True)
class Blame:
    """An error that ``code`` raised (or, for a scorer, whose output broke the contract) at ``line``."""

    code: UserCode
    error: BaseException
    line: str


def user_code(cfg: Any) -> list[UserCode]:
    """The reward scorer and the callbacks of ``cfg`` that are the user's own (module doc)."""
    named = [("reward._target_", (cfg.get("reward") or {}).get("_target_"))]
    named += [(f"callbacks.{name}._target_", spec.get("_target_"))
              for name, spec in (cfg.get("callbacks") or {}).items() if spec is not None]
    return [UserCode(key, str(target), *_source(str(target))) for key, target in named
            if target and not str(target).startswith(NOT_USER_CODE)]


def blame(err: BaseException, code: list[UserCode]) -> Optional[Blame]:
    """Which of the user's ``code`` ``err`` came from (``err`` or an error it was raised from or
    during): raised in a frame of its file, or, for the scorer, under ``SCORER_CALL``; else None."""
    seen: set[int] = set()
    scorer = next((c for c in code if c.key == "reward._target_"), None)
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        frames = traceback.extract_tb(err.__traceback__)
        for frame in reversed(frames):  # the innermost frame first: where it was raised
            for candidate in code:
                if candidate.raised_in(frame):
                    return Blame(candidate, err, f"{frame.filename}:{frame.lineno} in {frame.name}")
        if scorer is not None and any(f.filename.endswith(SCORER_CALL[0]) and f.name == SCORER_CALL[1]
                                      for f in frames):
            where = frames[-1]
            return Blame(scorer, err, f"{where.filename}:{where.lineno} in {where.name} (its output checked)")
        err = err.__cause__ or err.__context__
    return None


def _source(target: str) -> tuple[Optional[str], tuple[int, int]]:
    """The file and the lines (first, last) that define ``target`` (a dotted path); None and
    (0, 0) when they cannot be told."""
    from hydra.utils import get_object

    try:
        obj = get_object(target)
        obj = obj if inspect.isclass(obj) or inspect.isroutine(obj) else type(obj)
        lines, first = inspect.getsourcelines(obj)
        return inspect.getsourcefile(obj), (first, first + len(lines) - 1)
    except Exception:  # resolved at compose; a name that no longer resolves is blamed on nothing
        return None, (0, 0)


def _same_file(a: str, b: str) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return a == b
