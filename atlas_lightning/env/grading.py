"""Offline grading of a submit (README, "An episode"). Model output is read, never executed.

Correctness comes only from cached data: the question's ``ground_truth`` letter (GPQA) or the
``is_correct`` of the revealed candidate the submit names (LCB).

GPQA: the answer text is read as a choice letter the way common graders read it. Markdown
emphasis (``*``, `````, ``$``) and ``\\boxed{X}``/``\\text{X}`` wrappers are removed first, then:

1. the whole answer is one letter, optionally bracketed or followed by ``.``/``!`` and optionally
   after "option"/"choice": ``B``, ``b``, ``(B)``, ``[B]``, ``B)``, ``B.``, ``Option B``;
2. otherwise "answer" followed by ``is``, ``:`` or ``=`` and a capital letter standing alone:
   ``Answer: B``, ``The answer is (B).``, ``Final answer = C``. When such phrases name different
   letters the answer is ambiguous and reads as no letter;
3. otherwise the answer opens with a capital letter and a delimiter: ``B) 42 m/s``, ``(B) 42``,
   ``B. because``, ``B: 42``.

Anything else (``A or B``, ``I think B``, ``ABCD``, an empty string) reads as no letter and is
wrong. Lower-case letters count only under rule 1, where nothing else can be meant (in running text
"the answer is a function" must not read as ``A``).

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

from atlas_lightning.questions.schema import Candidate

_MARKUP = re.compile(r"[*`$]")
_WRAPPER = re.compile(r"\\(?:boxed|text|textbf|mathrm)\{([^{}]*)\}")
# No two whitespace runs may meet without a character between them (``\s*[)]?\s*`` backtracks
# quadratically on a long run of spaces): each optional piece carries its own whitespace.
_WHOLE_LETTER = re.compile(r"^(?:(?:option|choice)\s*)?(?:[\(\[]\s*)?([A-Za-z])\s*(?:[\)\]]\s*)?[.!]?$", re.IGNORECASE)
_ANSWER_PHRASE = re.compile(
    r"(?i:answer)\s*(?:(?i:is)(?:\s*:)?|:|=)\s*(?:(?i:option|choice)\s*)?[\(\[]?([A-Z])(?![A-Za-z0-9])"
)
_LEADING_LETTER = re.compile(r"^[\(\[]?([A-Z])[\)\]:.](?:\s|$)")
# At most 6 digits: int() of a huge digit string is slow and, past 4300 digits, refused.
_CANDIDATE_REF = re.compile(r"^(?:candidate\s*)?(?:#\s*)?(\d{1,6})\s*\.?$", re.IGNORECASE)


def _unwrap(text: str) -> str:
    text = _WRAPPER.sub(r"\1", text)
    return _MARKUP.sub("", text).strip()


def read_choice_letter(answer: str) -> str | None:
    """The upper-case choice letter ``answer`` names under the GPQA rules above, or ``None``."""
    text = _unwrap(answer)
    whole = _WHOLE_LETTER.match(text)
    if whole:
        return whole.group(1).upper()
    phrased = {m.group(1) for m in _ANSWER_PHRASE.finditer(text)}
    if phrased:
        return phrased.pop() if len(phrased) == 1 else None
    leading = _LEADING_LETTER.match(text)
    return leading.group(1) if leading else None


def read_candidate_reference(answer: str) -> int | None:
    """The k of ``#k`` (LCB rule 1), or ``None``. ``k`` is not range-checked here."""
    match = _CANDIDATE_REF.match(_unwrap(answer))
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
