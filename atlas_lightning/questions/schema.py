"""The question data model (README, "Question data"): one row a question with its cached candidates.

Parquet schema of ``<root>/<benchmark>/<split>.parquet`` (documented in the README):

=================  ===========================================================================
column             type and meaning
=================  ===========================================================================
question_id        string, unique within a file
benchmark          string, ``gpqa`` or ``lcb``
problem            string, the question as the orchestrator sees it (GPQA: with lettered choices)
ground_truth       string, GPQA: the correct letter; LCB: free text for readers (grading uses
                   the candidates' ``is_correct``)
data_source        string, where the question came from (e.g. ``gpqa_diamond``)
subset             string, a subset label for validation views (any ``subset_columns``)
candidates         list<struct<answer: string, approach: string, confidence: double,
                   cost_usd: double, is_correct: bool, solver_model: string>>, at least one
permutations       list<list<int32>>, optional: orders of the candidates; trajectory ``i`` of a
                   question uses ``permutations[i % len]``; empty or absent: derived from the
                   seed, the question id and ``i``
=================  ===========================================================================

Values the loader (``loader.py``) enforces, naming file, row and field when one is broken:
non-empty ``question_id`` (unique), ``problem`` and ``solver_model``; ``benchmark`` equal to the
file's; GPQA ``ground_truth`` a single capital letter; ``confidence`` in [0, 1]; ``cost_usd``
finite and >= 0; ``is_correct`` a bool; each permutation a permutation of
``range(len(candidates))``; null ``data_source`` reads as ``""``, null ``permutations`` as none.
Differently named files are read through ``data.columns`` (our name -> the file's; dotted keys
such as ``candidates.cost_usd`` rename candidate struct fields); see ``loader.py``.

Nothing here imports torch; these objects cross into the pure-Python runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BENCHMARKS = ("gpqa", "lcb")

#: Largest ``cost_usd`` a candidate may carry. A single cached answer costing more than a
#: million dollars is a data fault, and the bound keeps every reward (at most 64 explores of
#: ``-reward.cost_per_usd * cost_usd``, ``cost_per_usd`` <= 1e6) finite in float32.
MAX_COST_USD = 1e6

#: Top-level columns every file must have (after the column mapping).
REQUIRED_COLUMNS = ("question_id", "benchmark", "problem", "ground_truth", "candidates")
#: Optional top-level columns.
OPTIONAL_COLUMNS = ("data_source", "subset", "permutations")
#: Fields of each element of ``candidates``.
CANDIDATE_FIELDS = ("answer", "approach", "confidence", "cost_usd", "is_correct", "solver_model")


@dataclass(frozen=True)
class Candidate:
    """One cached answer produced earlier by a solver model at a known dollar cost."""

    answer: str  # GPQA: the chosen letter (with optional reasoning); LCB: the program text
    approach: str  # one-line description of how the solver got there
    confidence: float  # the solver's stated confidence in [0, 1]
    cost_usd: float  # what producing it cost, in US dollars (>= 0)
    is_correct: bool  # graded offline when the cache was built
    solver_model: str


@dataclass(frozen=True)
class Question:
    """A row of a question parquet. ``subsets`` maps each subset column to its value."""

    question_id: str
    benchmark: str
    problem: str
    ground_truth: str
    candidates: tuple[Candidate, ...]
    data_source: str = ""
    subsets: dict[str, str] = field(default_factory=dict, hash=False)
    permutations: tuple[tuple[int, ...], ...] = ()
