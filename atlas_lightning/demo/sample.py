"""The bundled sample: synthetic questions with cached candidates, in the loader's schema.

``build_sample(out, seed)`` writes ``<out>/{gpqa,lcb}/{train,val_full}.parquet`` (416 questions,
8 candidates each), byte-identical for the same seed. The texts come from ``sample_texts.py``;
this module decides the *candidate structure*, which is what a tiny orchestrator can learn from:

- eight solver models in three price tiers, one candidate each: cheap ($0.001-0.01, least
  accurate, over-confident), mid ($0.02-0.10), expensive ($0.15-0.60, most accurate, their
  confidence tracks correctness). LCB candidates cost more within each model's range.
- question archetypes: ``all_right`` (any candidate will do: stop after one), ``none_right``
  (spending cannot help), ``cheap_wrong`` (the cheap solvers agree on the same trap answer and
  only the expensive ones are right), ``graded`` (a latent difficulty lowers every tier's
  accuracy). Their mix depends on the subset (LCB ``hard`` has more ``cheap_wrong``).
- wrong GPQA candidates favour one trap distractor per question, so a majority of cheap answers
  can be wrong together; wrong LCB candidates are buggy programs, favouring one trap bug.
- eight permutations of the candidates per question (the reveal orders of trajectories).

So neither "explore none" nor "explore all" is optimal: one candidate settles an ``all_right``
question, a ``cheap_wrong`` one needs a revealed expensive candidate, and confident agreement is
evidence worth stopping for. ``tests/demo/test_sample.py`` measures this on the built sample.

Who calls it: the CLI (``atlas-lightning data sample --out DIR``), tests, and the tiny
tokenizer's corpus (``generate_questions``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from atlas_lightning.questions.loader import write_questions
from atlas_lightning.demo.sample_texts import choice_item, code_item
from atlas_lightning.questions.schema import Candidate, Question


@dataclass(frozen=True)
class Solver:
    name: str
    tier: str  # "cheap", "mid" or "expensive"
    cost_low: float  # USD per answer
    cost_high: float


SOLVERS: tuple[Solver, ...] = (
    Solver("qwen3-4b", "cheap", 0.001, 0.004),
    Solver("gpt-4.1-nano", "cheap", 0.002, 0.006),
    Solver("gemini-2.0-flash-lite", "cheap", 0.003, 0.010),
    Solver("qwen3-235b-a22b", "mid", 0.020, 0.050),
    Solver("gpt-4.1-mini", "mid", 0.030, 0.080),
    Solver("claude-3.5-haiku", "mid", 0.040, 0.100),
    Solver("o3", "expensive", 0.150, 0.400),
    Solver("claude-opus-4", "expensive", 0.250, 0.600),
)

#: Questions per file of the sample.
SAMPLE_COUNTS: dict[tuple[str, str], int] = {
    ("gpqa", "train"): 160,
    ("gpqa", "val_full"): 48,
    ("lcb", "train"): 160,
    ("lcb", "val_full"): 48,
}

#: Archetype weights (all_right, none_right, cheap_wrong, graded) per subset.
_ARCHETYPES = ("all_right", "none_right", "cheap_wrong", "graded")
_ARCHETYPE_WEIGHTS = {
    "physics": (0.15, 0.10, 0.30, 0.45),
    "chemistry": (0.18, 0.08, 0.27, 0.47),
    "biology": (0.20, 0.08, 0.25, 0.47),
    "easy": (0.35, 0.04, 0.16, 0.45),
    "medium": (0.15, 0.10, 0.30, 0.45),
    "hard": (0.05, 0.20, 0.40, 0.35),
}
_LCB_DIFFICULTY = (("easy", 0.35), ("medium", 0.40), ("hard", 0.25))

# (low, high) of the stated confidence, for (tier, is_correct): cheap solvers sound as sure when
# wrong as when right; expensive ones are calibrated. This is the signal worth paying for.
_CONFIDENCE = {
    ("cheap", True): (0.55, 0.95),
    ("cheap", False): (0.50, 0.92),
    ("mid", True): (0.60, 0.95),
    ("mid", False): (0.35, 0.80),
    ("expensive", True): (0.78, 0.99),
    ("expensive", False): (0.30, 0.70),
}
_STYLE = {
    "cheap": ("quick estimate via", "{derivation}"),
    "mid": ("worked solution using", "Method: {method}. {derivation}"),
    "expensive": ("careful derivation with", "Method: {method}. {derivation} Units and limiting cases check out."),
}
_CODE_STYLE = {"cheap": "first draft,", "mid": "tested on the examples,", "expensive": "edge cases reviewed,"}
_LETTERS = "ABCD"


def _correctness(rng: random.Random, archetype: str) -> list[bool]:
    """Which of ``SOLVERS`` (in order) answer correctly."""
    tiers = [solver.tier for solver in SOLVERS]
    if archetype == "all_right":
        return [True] * len(tiers)
    if archetype == "none_right":
        return [False] * len(tiers)
    if archetype == "cheap_wrong":
        chance = {"cheap": 0.0, "mid": 0.3, "expensive": 0.9}
        right = [rng.random() < chance[tier] for tier in tiers]
        if not any(r for r, tier in zip(right, tiers) if tier == "expensive"):
            right[tiers.index("expensive") + rng.randrange(tiers.count("expensive"))] = True
        return right
    difficulty = rng.random()
    accuracy = {"cheap": 0.75 - 0.55 * difficulty, "mid": 0.88 - 0.45 * difficulty, "expensive": 0.97 - 0.3 * difficulty}
    return [rng.random() < accuracy[tier] for tier in tiers]


def _wrong_choice(rng: random.Random, trap: int, others: list[int], archetype: str, tier: str) -> int:
    if archetype == "cheap_wrong" and tier == "cheap":
        return trap
    return trap if rng.random() < 0.6 else rng.choice(others)


def _cost(rng: random.Random, solver: Solver, benchmark: str) -> float:
    share = rng.random()
    if benchmark == "lcb":
        share = share**0.7  # programs are longer answers: the upper part of each model's range
    return round(solver.cost_low + share * (solver.cost_high - solver.cost_low), 6)


def _confidence(rng: random.Random, tier: str, correct: bool) -> float:
    low, high = _CONFIDENCE[(tier, correct)]
    return round(rng.uniform(low, high), 2)


def _gpqa_question(rng: random.Random, question_id: str) -> Question:
    item = choice_item(rng)
    order = rng.sample(range(len(item.options)), len(item.options))  # order[k]: option at letter k
    letter_of = {option: _LETTERS[k] for k, option in enumerate(order)}
    problem = item.stem + "\n\n" + "\n".join(f"{_LETTERS[k]}) {item.options[o][0]}" for k, o in enumerate(order))
    archetype = rng.choices(_ARCHETYPES, _ARCHETYPE_WEIGHTS[item.subset])[0]
    distractors = list(range(1, len(item.options)))
    trap = rng.choice(distractors)
    candidates = []
    for solver, correct in zip(SOLVERS, _correctness(rng, archetype)):
        option = 0 if correct else _wrong_choice(rng, trap, distractors, archetype, solver.tier)
        qualifier, template = _STYLE[solver.tier]
        answer = template.format(method=item.method, derivation=item.options[option][1])
        candidates.append(
            Candidate(
                answer=f"{answer}\nAnswer: {letter_of[option]}",
                approach=f"{qualifier} {item.method}",
                confidence=_confidence(rng, solver.tier, correct),
                cost_usd=_cost(rng, solver, "gpqa"),
                is_correct=correct,
                solver_model=solver.name,
            )
        )
    return Question(
        question_id=question_id,
        benchmark="gpqa",
        problem=problem,
        ground_truth=letter_of[0],
        candidates=tuple(candidates),
        data_source="synthetic_gpqa",
        subsets={"subset": item.subset},
        permutations=_permutations(rng, len(candidates)),
    )


def _lcb_question(rng: random.Random, question_id: str) -> Question:
    difficulty = rng.choices([d for d, _ in _LCB_DIFFICULTY], [w for _, w in _LCB_DIFFICULTY])[0]
    item = code_item(rng, difficulty)
    archetype = rng.choices(_ARCHETYPES, _ARCHETYPE_WEIGHTS[item.subset])[0]
    bugs = list(range(1, len(item.programs)))
    trap = rng.choice(bugs)
    candidates = []
    for solver, correct in zip(SOLVERS, _correctness(rng, archetype)):
        program = 0 if correct else _wrong_choice(rng, trap, bugs, archetype, solver.tier)
        candidates.append(
            Candidate(
                answer=item.programs[program],
                approach=f"{_CODE_STYLE[solver.tier]} {item.method}",
                confidence=_confidence(rng, solver.tier, correct),
                cost_usd=_cost(rng, solver, "lcb"),
                is_correct=correct,
                solver_model=solver.name,
            )
        )
    return Question(
        question_id=question_id,
        benchmark="lcb",
        problem=item.statement,
        ground_truth=item.programs[0],
        candidates=tuple(candidates),
        data_source="synthetic_lcb",
        subsets={"subset": item.subset},
        permutations=_permutations(rng, len(candidates)),
    )


def _permutations(rng: random.Random, n: int, count: int = 8) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(rng.sample(range(n), n)) for _ in range(count))


def generate_questions(benchmark: str, split: str, count: int, seed: int = 0) -> list[Question]:
    """``count`` synthetic questions of ``benchmark`` (``gpqa`` or ``lcb``), ids ``<benchmark>-<split>-NNNN``.

    Deterministic in (benchmark, split, count, seed); each file has its own random stream, so the
    files of one seed do not depend on each other's sizes.
    """
    makers = {"gpqa": _gpqa_question, "lcb": _lcb_question}
    if benchmark not in makers:
        raise ValueError(f"unknown benchmark {benchmark!r} (known: {', '.join(makers)})")
    rng = random.Random(f"atlas-sample/{seed}/{benchmark}/{split}")
    return [makers[benchmark](rng, f"{benchmark}-{split}-{index:04d}") for index in range(count)]


def build_sample(out: Path, seed: int = 0) -> dict:
    """Write the sample under ``out`` and return a summary.

    Summary: ``{"out": str, "seed": int, "files": {"gpqa/train.parquet": n_questions, ...},
    "questions": total, "candidates": total}``. Files are written atomically; existing sample
    files are replaced, other files under ``out`` are left alone.
    """
    out = Path(out)
    files: dict[str, int] = {}
    candidates = 0
    for (benchmark, split), count in SAMPLE_COUNTS.items():
        questions = generate_questions(benchmark, split, count, seed)
        write_questions(out / benchmark / f"{split}.parquet", questions)
        files[f"{benchmark}/{split}.parquet"] = len(questions)
        candidates += sum(len(q.candidates) for q in questions)
    return {"out": str(out), "seed": seed, "files": files, "questions": sum(files.values()), "candidates": candidates}
