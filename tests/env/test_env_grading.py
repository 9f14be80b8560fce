"""Grading rules of atlas_lightning/env/grading.py against hand-written expectations."""

import pytest

from atlas_lightning.questions.schema import Candidate
from atlas_lightning.env.grading import (
    RevealedCandidate,
    grade_gpqa,
    grade_lcb,
    normalize_code,
    read_candidate_reference,
    read_choice_letter,
)


@pytest.mark.parametrize("answer, letter", [
    ("B", "B"), ("b", "B"), (" (B) ", "B"), ("[C]", "C"), ("B)", "B"), ("D.", "D"), ("Option B", "B"),
    ("choice (a)", "A"), ("**B**", "B"), ("$\\boxed{C}$", "C"), ("\\boxed{D}", "D"),
    ("Answer: B", "B"), ("answer: (C)", "C"), ("The answer is B", "B"), ("The answer is (B).", "B"),
    ("The correct answer is: **A**", "A"), ("Final answer = D", "D"), ("The answer is option C", "C"),
    ("After weighing both, the answer is A because of energy conservation.", "A"),
    ("Answer: B. Final answer: B", "B"),
    ("B) 42 m/s", "B"), ("(C) 3 mol", "C"), ("A. It is the first", "A"), ("D: none", "D"),
])
def test_letters_read_as_graders_read_them(answer, letter):
    assert read_choice_letter(answer) == letter


@pytest.mark.parametrize("answer", [
    "", "   ", "A or B", "I think B", "ABCD", "(A)(B)", "Answer: A. Answer: B",
    "the answer is a function of x", "Bonus", "42", "#2", "\ufffd", "\udcff",
])
def test_unreadable_or_ambiguous_answers_read_as_no_letter(answer):
    assert read_choice_letter(answer) is None


def test_gpqa_grade_compares_with_ground_truth():
    assert grade_gpqa("The answer is B", "B") == {"rule": "letter", "letter": "B", "acc": 1}
    assert grade_gpqa("C", "B")["acc"] == 0
    assert grade_gpqa("B or C", "B") == {"rule": "no_letter", "letter": None, "acc": 0}


@pytest.mark.parametrize("answer, k", [
    ("#2", 2), ("2", 2), (" # 3 ", 3), ("Candidate #1", 1), ("candidate 4.", 4), ("**#2**", 2),
    ("#0", 0), ("#99", 99), ("#2 because", None), ("two", None), ("#" + "9" * 5000, None), ("", None),
])
def test_candidate_references(answer, k):
    assert read_candidate_reference(answer) == k


def test_normalize_code():
    fenced = "```python\r\ndef f():  \r\n    return 1\r\n```\n\n"
    assert normalize_code(fenced) == "def f():\n    return 1"
    assert normalize_code("\n\ndef f():\n    return 1   \n") == "def f():\n    return 1"
    assert normalize_code("   ") == ""


def _revealed(*specs):
    return [
        RevealedCandidate(explore_k=k, candidate_idx=idx,
                          candidate=Candidate(answer=code, approach="", confidence=0.5, cost_usd=0.1,
                                              is_correct=ok, solver_model="m"))
        for k, (idx, code, ok) in enumerate(specs, start=1)
    ]


def test_lcb_grades_the_named_revealed_candidate():
    revealed = _revealed((5, "print(1)", False), (2, "print(2)", True))
    assert grade_lcb("#2", revealed) == {"rule": "candidate_ref", "candidate_k": 2, "candidate_idx": 2, "acc": 1}
    assert grade_lcb("#1", revealed)["acc"] == 0
    assert grade_lcb("#3", revealed) == {"rule": "unrevealed_ref", "candidate_k": 3, "candidate_idx": None, "acc": 0}
    assert grade_lcb("#0", revealed)["acc"] == 0
    assert grade_lcb("#1", [])["rule"] == "unrevealed_ref"


def test_lcb_verbatim_code_of_a_revealed_candidate():
    revealed = _revealed((5, "print(1)", False), (2, "print(2)", True))
    graded = grade_lcb("```python\nprint(2)\n```", revealed)
    assert graded == {"rule": "verbatim_code", "candidate_k": 2, "candidate_idx": 2, "acc": 1}
    assert grade_lcb("print(3)", revealed) == {"rule": "unmatched", "candidate_k": None, "candidate_idx": None, "acc": 0}
    assert grade_lcb("", revealed)["rule"] == "empty"


def test_identical_code_graded_differently_is_not_rewarded():
    revealed = _revealed((0, "print(2)", True), (1, "print(2)", False))
    assert grade_lcb("print(2)", revealed)["acc"] == 0
