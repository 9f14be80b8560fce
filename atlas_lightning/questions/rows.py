"""One parquet row <-> one ``Question``, with every value checked.

A row here is a plain dict keyed by *our* column names (after the column mapping), with
``candidates`` a list of dicts keyed by our candidate field names, exactly as
``pyarrow.Table.to_pylist()`` yields it. ``question_from_row`` refuses a bad value with a
``DataError`` whose message names the place (``gpqa/train.parquet row 17 (question_id=gpqa-0017)``),
the field (``candidates[3].cost_usd``) and what is wrong (``NaN``).

Who calls it: ``loader.load_questions`` (reading) and ``loader.write_questions`` (the same checks
before anything is written, so no file we write can fail to load).
"""

from __future__ import annotations

import math
import re
from typing import Any

from atlas_lightning.errors import InputError
from atlas_lightning.questions.letters import choice_letters, read_choice_letter
from atlas_lightning.questions.schema import BENCHMARKS, CANDIDATE_FIELDS, MAX_COST_USD, Candidate, Question


class DataError(InputError):
    """A question file or row that cannot be used; the message names file, row and field."""


_GPQA_LETTER = re.compile(r"[A-Z]")
def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {_short(value)}"


class _RowChecker:
    """Checks the values of one row; ``fail`` raises with the row's place and the field."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, field: str, problem: str) -> DataError:
        return DataError(f"{self.where} field {field}: {problem}")

    def string(self, value: Any, field: str, *, non_empty: bool = False) -> str:
        if value is None:
            raise self.fail(field, "missing (null)")
        if not isinstance(value, str):
            raise self.fail(field, f"expected a string, got {_describe(value)}")
        if non_empty and not value.strip():
            raise self.fail(field, "empty string")
        return value

    def number(self, value: Any, field: str, *, low: float, high: float = math.inf) -> float:
        if value is None:
            raise self.fail(field, "missing (null)")
        # bool is an int subclass: a True cost is a type error, not $1.
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(field, f"expected a number, got {_describe(value)}")
        number = float(value)
        if math.isnan(number):
            raise self.fail(field, "NaN")
        if math.isinf(number):
            raise self.fail(field, f"infinite ({number})")
        if number < low:
            raise self.fail(field, f"{number} is below {low:g}" if low else f"negative ({number})")
        if number > high:
            raise self.fail(field, f"{number} is above {high:g}")
        return number

    def boolean(self, value: Any, field: str) -> bool:
        if value is None:
            raise self.fail(field, "missing (null)")
        if not isinstance(value, bool):
            raise self.fail(field, f"expected a bool, got {_describe(value)}")
        return value


def _candidate(check: _RowChecker, value: Any, index: int) -> Candidate:
    field = f"candidates[{index}]"
    if not isinstance(value, dict):
        raise check.fail(field, f"expected a struct with fields {', '.join(CANDIDATE_FIELDS)}, got {_describe(value)}")
    missing = [name for name in CANDIDATE_FIELDS if name not in value]
    if missing:
        raise check.fail(f"{field}.{missing[0]}", f"missing (the struct has {', '.join(sorted(value)) or 'no fields'})")
    return Candidate(
        answer=check.string(value["answer"], f"{field}.answer"),
        approach=check.string(value["approach"], f"{field}.approach"),
        confidence=check.number(value["confidence"], f"{field}.confidence", low=0.0, high=1.0),
        cost_usd=check.number(value["cost_usd"], f"{field}.cost_usd", low=0.0, high=MAX_COST_USD),
        is_correct=check.boolean(value["is_correct"], f"{field}.is_correct"),
        solver_model=check.string(value["solver_model"], f"{field}.solver_model", non_empty=True),
    )


def _permutations(check: _RowChecker, value: Any, n_candidates: int) -> tuple[tuple[int, ...], ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise check.fail("permutations", f"expected a list of lists of ints, got {_describe(value)}")
    expected = list(range(n_candidates))
    result = []
    for index, perm in enumerate(value):
        field = f"permutations[{index}]"
        if not isinstance(perm, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in perm):
            raise check.fail(field, f"expected a list of ints, got {_describe(perm)}")
        if sorted(perm) != expected:
            raise check.fail(field, f"{_short(list(perm))} is not a permutation of range({n_candidates})")
        result.append(tuple(perm))
    return tuple(result)


#: ``data.label_conflicts``: what a GPQA row whose ``ground_truth`` contradicts a candidate's
#: ``is_correct`` gets: refused (``refuse``, the default), or loaded as it is (``keep``: grading
#: then follows ``ground_truth`` while ``found_correct`` follows ``is_correct``, so the two may disagree).
LABEL_CONFLICT_POLICIES = ("refuse", "keep")


def question_from_row(row: dict[str, Any], where: str, benchmark: str, subset_columns: tuple[str, ...],
                      label_conflicts: str = "refuse") -> Question:
    """Build a ``Question`` from ``row`` (our column names), checking every value.

    ``where`` names the row for messages, e.g. ``gpqa/train.parquet row 17``; the question id is
    appended once known. ``benchmark`` is the file's benchmark: a row naming another one is refused.
    ``subset_columns`` are the subset columns present in the file (each must hold a string).
    Optional columns may be absent from ``row`` or null: ``data_source`` -> ``""``,
    ``permutations`` -> ``()``. ``label_conflicts``: see ``LABEL_CONFLICT_POLICIES`` (a GPQA
    candidate whose answer names a letter must be ``is_correct`` exactly when that letter is the
    ``ground_truth``; answers that name no letter cannot be checked).
    """
    question_id = row.get("question_id")
    label = question_id if isinstance(question_id, str) and question_id else "?"
    check = _RowChecker(f"{where} (question_id={label})")
    question_id = check.string(question_id, "question_id", non_empty=True)

    row_benchmark = check.string(row.get("benchmark"), "benchmark", non_empty=True)
    if row_benchmark not in BENCHMARKS:
        raise check.fail("benchmark", f"unknown benchmark {row_benchmark!r} (known: {', '.join(BENCHMARKS)})")
    if row_benchmark != benchmark:
        raise check.fail("benchmark", f"{row_benchmark!r} in a {benchmark} file")

    problem = check.string(row.get("problem"), "problem", non_empty=True)
    ground_truth = check.string(row.get("ground_truth"), "ground_truth")
    if benchmark == "gpqa":
        if not _GPQA_LETTER.fullmatch(ground_truth):
            raise check.fail("ground_truth", f"GPQA needs one capital letter A-Z, got {ground_truth!r}")
        letters = choice_letters(problem)
        if not letters:
            raise check.fail("problem", "shows no lettered choices (lines such as 'A) ...' or '(A) ...'): "
                                        "no submitted letter could be graded")
        if ground_truth not in letters:
            raise check.fail("ground_truth", f"{ground_truth!r} is not one of the problem's choices "
                                             f"({', '.join(letters)}): the question could never be answered right")

    data_source = row.get("data_source")
    data_source = "" if data_source is None else check.string(data_source, "data_source")
    subsets = {name: check.string(row.get(name), name) for name in subset_columns}

    raw_candidates = row.get("candidates")
    if raw_candidates is None:
        raise check.fail("candidates", "missing (null)")
    if not isinstance(raw_candidates, (list, tuple)):
        raise check.fail("candidates", f"expected a list of structs, got {_describe(raw_candidates)}")
    if not raw_candidates:
        raise check.fail("candidates", "empty list (a question needs at least one candidate)")
    candidates = tuple(_candidate(check, value, index) for index, value in enumerate(raw_candidates))
    if benchmark == "gpqa" and label_conflicts == "refuse":
        _check_gpqa_labels(check, candidates, ground_truth)

    return Question(
        question_id=question_id,
        benchmark=row_benchmark,
        problem=problem,
        ground_truth=ground_truth,
        candidates=candidates,
        data_source=data_source,
        subsets=subsets,
        permutations=_permutations(check, row.get("permutations"), len(candidates)),
    )


def _check_gpqa_labels(check: _RowChecker, candidates: tuple[Candidate, ...], ground_truth: str) -> None:
    """Each candidate whose answer names a letter is cached correct iff that letter is the ground truth."""
    for index, candidate in enumerate(candidates):
        letter = read_choice_letter(candidate.answer)
        if letter is not None and (letter == ground_truth) != candidate.is_correct:
            raise check.fail(f"candidates[{index}].is_correct",
                             f"{candidate.is_correct} contradicts ground_truth {ground_truth!r} (the candidate answers "
                             f"{letter!r}): grading and found_correct would disagree; fix the row, or load such rows "
                             f"as they are with data.label_conflicts=keep")


def question_to_row(question: Question) -> dict[str, Any]:
    """The row ``write_questions`` stores for ``question`` (our column names; subsets flattened)."""
    row: dict[str, Any] = {
        "question_id": question.question_id,
        "benchmark": question.benchmark,
        "problem": question.problem,
        "ground_truth": question.ground_truth,
        "data_source": question.data_source,
    }
    row.update(question.subsets)
    row["candidates"] = [
        {name: getattr(candidate, name) for name in CANDIDATE_FIELDS} for candidate in question.candidates
    ]
    row["permutations"] = [list(perm) for perm in question.permutations]
    return row
