"""GPQA's choice letters: the letters a problem offers (``choice_letters``) and the letter an
answer names (``read_choice_letter``). The grader reads a submit with it (``env/grading.py``)
and the loader reads each cached candidate's answer with it, so that a row whose
``ground_truth`` contradicts its candidates' ``is_correct`` is caught where it is loaded.

An answer is read as a choice letter the way common graders read it. Markdown
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
"""

from __future__ import annotations

import re

_MARKUP = re.compile(r"[*`$]")
_WRAPPER = re.compile(r"\\(?:boxed|text|textbf|mathrm)\{([^{}]*)\}")
# No two whitespace runs may meet without a character between them (``\s*[)]?\s*`` backtracks
# quadratically on a long run of spaces): each optional piece carries its own whitespace.
_WHOLE_LETTER = re.compile(r"^(?:(?:option|choice)\s*)?(?:[\(\[]\s*)?([A-Za-z])\s*(?:[\)\]]\s*)?[.!]?$", re.IGNORECASE)
_ANSWER_PHRASE = re.compile(
    r"(?i:answer)\s*(?:(?i:is)(?:\s*:)?|:|=)\s*(?:(?i:option|choice)\s*)?[\(\[]?([A-Z])(?![A-Za-z0-9])"
)
_LEADING_LETTER = re.compile(r"^[\(\[]?([A-Z])[\)\]:.](?:\s|$)")
#: A choice line of a GPQA problem: ``A) ...``, ``(A) ...``, ``A. ...``, ``A: ...``, ``[A] ...``.
_CHOICE_LINE = re.compile(r"^[ \t]*[\(\[]?([A-Za-z])[\)\]\.:](?=[ \t]|$)", re.MULTILINE)
#: Choices written inline: ``... (A) 2 atm (B) 3 atm ...``.
_CHOICE_INLINE = re.compile(r"\(([A-Z])\)")


def choice_letters(problem: str) -> str:
    """The letters of a GPQA problem's choices, ``"ABCD"`` for four: the run ``A, B, C, ...`` of
    choice lines (``A) ...``, ``(B) ...``, ``C. ...``; case-insensitive), or, when the problem has
    no choice lines, of inline ``(A)`` markers. Letters that do not continue the run from ``A``
    (a line starting ``I. ...`` in the statement) are not choices. ``""`` when there are none."""
    for pattern in (_CHOICE_LINE, _CHOICE_INLINE):
        found = {m.group(1).upper() for m in pattern.finditer(problem)}
        run = ""
        while chr(ord("A") + len(run)) in found:
            run += chr(ord("A") + len(run))
        if run:
            return run
    return ""


def unwrap_markup(text: str) -> str:
    """``text`` without Markdown emphasis (``*``, `````, ``$``) and ``\\boxed{X}``-style wrappers, stripped."""
    text = _WRAPPER.sub(r"\1", text)
    return _MARKUP.sub("", text).strip()


def read_choice_letter(answer: str) -> str | None:
    """The upper-case choice letter ``answer`` names under the module's rules, or ``None``."""
    text = unwrap_markup(answer)
    whole = _WHOLE_LETTER.match(text)
    if whole:
        return whole.group(1).upper()
    phrased = {m.group(1) for m in _ANSWER_PHRASE.finditer(text)}
    if phrased:
        return phrased.pop() if len(phrased) == 1 else None
    leading = _LEADING_LETTER.match(text)
    return leading.group(1) if leading else None
