"""Offline grading of a submit (README, "An episode"). Model output is read, never executed.

Correctness comes only from cached data: the question's ``ground_truth`` letter (GPQA) or the
``is_correct`` of the revealed candidate the submit names (LCB).

GPQA: the answer is read as a choice letter by ``questions/letters.py`` (its rules there).

LCB: the submit names one of *this trajectory's revealed* candidates, whose code is submitted:

1. ``#k``, ``k``, ``candidate #k`` (k-th revealed, 1-based): correct iff that candidate's cached
   ``is_correct``; a k that was not revealed (out of range, or never explored) is wrong;
2. otherwise the code of a revealed candidate verbatim (compared after normalising line ends,
   trailing spaces, surrounding blank lines and a surrounding Markdown code fence): correct iff
   every revealed candidate with that code is cached correct (identical code graded differently
   would be a data fault; it is not rewarded);
3. anything else (prose, unrevealed code, an empty answer) is wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from atlas_lightning.questions.letters import read_choice_letter, unwrap_markup
from atlas_lightning.questions.schema import Candidate

__all__ = ["read_choice_letter", "grade_gpqa", "grade_lcb", "read_candidate_reference", "normalize_code",
           "RevealedCandidate"]

# At most 6 digits: int() of a huge digit string is slow and, past 4300 digits, refused.
_CANDIDATE_REF = re.compile(r"^(?:candidate\s*)?(?:#\s*)?(\d{1,6})\s*\.?$", re.IGNORECASE)


def read_candidate_reference(answer: str) -> int | None:
    """The k of ``#k`` (LCB rule 1), or ``None``. ``k`` is not range-checked here."""
    match = _CANDIDATE_REF.match(unwrap_markup(answer))
    return int(match.group(1)) if match else None


def normalize_code(code: str) -> str:
    """Code as compared verbatim: ``\\n`` line ends, no trailing spaces, no surrounding blank
    lines, no surrounding Markdown fence."""
    lines = [line.rstrip() for line in code.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    lines = _trim_blank(lines)
    if len(lines) >= 2 and lines[0].lstrip().startswith("```") and lines[-1].strip() == "```":
        lines = _trim_blank(lines[1:-1])
    return "\n".join(lines)


def _trim_blank(lines: list[str]) -> list[str]:
    """``lines`` without leading and trailing empty lines, in one slice (linear: popping the
    front of a list one line at a time is quadratic on a megabyte of blank lines)."""
    start, end = 0, len(lines)
    while start < end and not lines[start]:
        start += 1
    while end > start and not lines[end - 1]:
        end -= 1
    return lines[start:end]


@dataclass(frozen=True)
class RevealedCandidate:
    """A candidate this trajectory revealed: ``explore_k`` (1-based reveal order) and
    ``candidate_idx`` (its index in ``question.candidates``)."""

    explore_k: int
    candidate_idx: int
    candidate: Candidate


def grade_gpqa(answer: str, ground_truth_letter: str) -> dict:
    """``{"rule", "letter", "acc"}``: ``acc`` is 1 iff the letter read equals the ground truth."""
    letter = read_choice_letter(answer)
    return {
        "rule": "letter" if letter else "no_letter",
        "letter": letter,
        "acc": int(letter is not None and letter == ground_truth_letter),
    }


def grade_lcb(answer: str, revealed: Sequence[RevealedCandidate]) -> dict:
    """``{"rule", "candidate_k", "candidate_idx", "acc"}`` under the LCB rules above."""
    reference = read_candidate_reference(answer)
    if reference is not None:
        if 1 <= reference <= len(revealed):
            chosen = revealed[reference - 1]
            return {
                "rule": "candidate_ref",
                "candidate_k": chosen.explore_k,
                "candidate_idx": chosen.candidate_idx,
                "acc": int(bool(chosen.candidate.is_correct)),
            }
        return {"rule": "unrevealed_ref", "candidate_k": reference, "candidate_idx": None, "acc": 0}
    code = normalize_code(answer)
    matches = [r for r in revealed if code and normalize_code(r.candidate.answer) == code]
    if matches:
        return {
            "rule": "verbatim_code",
            "candidate_k": matches[0].explore_k,
            "candidate_idx": matches[0].candidate_idx,
            "acc": int(all(bool(r.candidate.is_correct) for r in matches)),
        }
    return {"rule": "empty" if not code else "unmatched", "candidate_k": None, "candidate_idx": None, "acc": 0}
