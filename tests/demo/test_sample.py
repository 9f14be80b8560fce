"""The bundled sample: deterministic, loadable, and shaped so that spending matters."""

from __future__ import annotations

import re
import statistics
from collections import defaultdict

import pytest

from atlas_lightning.config import RewardConfig
from atlas_lightning.questions.loader import load_questions
from atlas_lightning.demo.sample import SAMPLE_COUNTS, SOLVERS, build_sample, generate_questions

FILES = [f"{b}/{s}.parquet" for b, s in SAMPLE_COUNTS]
TIER_COST = {"cheap": (0.001, 0.01), "mid": (0.02, 0.10), "expensive": (0.15, 0.60)}


@pytest.fixture(scope="module")
def sample(sample_data_dir):
    return {(b, s): load_questions(sample_data_dir, b, s) for b, s in SAMPLE_COUNTS}


def test_same_seed_gives_identical_files_and_other_seed_differs(sample_data_dir, tmp_path):
    summary = build_sample(tmp_path / "again", seed=0)
    assert summary["files"] == {f: SAMPLE_COUNTS[tuple(f[: -len(".parquet")].split("/"))] for f in FILES}
    assert summary["questions"] == 416 and summary["candidates"] == 416 * 8
    for name in FILES:
        assert (tmp_path / "again" / name).read_bytes() == (sample_data_dir / name).read_bytes(), name
    build_sample(tmp_path / "other", seed=1)
    assert all((tmp_path / "other" / n).read_bytes() != (sample_data_dir / n).read_bytes() for n in FILES)


def test_files_load_back_as_generated(sample):
    for (benchmark, split), count in SAMPLE_COUNTS.items():
        assert sample[(benchmark, split)] == generate_questions(benchmark, split, count, seed=0)


def test_candidates_come_from_every_tier_at_its_price(sample):
    tier_of = {s.name: s.tier for s in SOLVERS}
    for questions in sample.values():
        for q in questions:
            assert sorted(c.solver_model for c in q.candidates) == sorted(tier_of)
            assert len(q.permutations) == 8
            for c in q.candidates:
                low, high = TIER_COST[tier_of[c.solver_model]]
                assert low <= c.cost_usd <= high, (q.question_id, c)


def test_expensive_solvers_are_more_accurate_and_better_calibrated(sample):
    tier_of = {s.name: s.tier for s in SOLVERS}
    correct, confidence = defaultdict(list), defaultdict(list)
    for questions in sample.values():
        for q in questions:
            for c in q.candidates:
                correct[tier_of[c.solver_model]].append(c.is_correct)
                confidence[(tier_of[c.solver_model], c.is_correct)].append(c.confidence)
    accuracy = {tier: statistics.mean(v) for tier, v in correct.items()}
    assert accuracy["cheap"] + 0.1 < accuracy["mid"] < accuracy["expensive"] - 0.1, accuracy
    gap = {t: statistics.mean(confidence[(t, True)]) - statistics.mean(confidence[(t, False)]) for t in TIER_COST}
    assert gap["cheap"] < 0.1 < 0.2 < gap["expensive"], gap


def test_every_file_has_the_questions_that_make_spending_matter(sample):
    tier_of = {s.name: s.tier for s in SOLVERS}
    for key, questions in sample.items():
        kinds = defaultdict(int)
        for q in questions:
            right = [c.is_correct for c in q.candidates]
            cheap = [c.is_correct for c in q.candidates if tier_of[c.solver_model] == "cheap"]
            expensive = [c.is_correct for c in q.candidates if tier_of[c.solver_model] == "expensive"]
            kinds["all_right"] += all(right)
            kinds["none_right"] += not any(right)
            kinds["only_expensive_right"] += not any(cheap) and any(expensive)
        assert min(kinds.values()) >= 0.05 * len(questions), (key, dict(kinds))


def test_answers_agree_with_correctness_and_subsets(sample):
    for (benchmark, _), questions in sample.items():
        subsets = {q.subsets["subset"] for q in questions}
        if benchmark == "gpqa":
            assert subsets == {"physics", "chemistry", "biology"}
            for q in questions:
                assert re.search(rf"^{q.ground_truth}\) ", q.problem, re.M)
                for c in q.candidates:
                    assert c.is_correct == c.answer.endswith(f"Answer: {q.ground_truth}"), (q.question_id, c)
        else:
            assert subsets == {"easy", "medium", "hard"}
            for q in questions:
                for c in q.candidates:
                    assert c.is_correct == (c.answer == q.ground_truth), (q.question_id, c)


def test_texts_are_short_for_a_2048_token_context(sample, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for questions in sample.values():
        for q in questions:
            assert 40 <= len(tokenizer.encode(q.problem)) <= 160, q.question_id
            for c in q.candidates:
                assert 8 <= len(tokenizer.encode(c.answer)) <= 130, (q.question_id, c.answer)


# A reference orchestrator on the stored permutations, with the report's reward: acc - lambda * dollars.


def _key(benchmark, candidate):
    return candidate.answer.rsplit("Answer: ", 1)[-1] if benchmark == "gpqa" else candidate.answer


def _submit(benchmark, revealed, question):
    """Confidence-weighted vote, expensive answers weighing more; nothing revealed: guess A / nothing."""
    if not revealed:
        return benchmark == "gpqa" and question.ground_truth == "A"
    score, first = defaultdict(float), {}
    for c in revealed:
        weight = 3.0 if c.cost_usd >= 0.15 else 1.5 if c.cost_usd >= 0.02 else 1.0
        score[_key(benchmark, c)] += weight * c.confidence
        first.setdefault(_key(benchmark, c), c)
    return first[max(score, key=score.get)].is_correct


def _adaptive_stop(benchmark, revealed):
    """Stop on a confident expensive answer, or on a confident agreement that includes a non-cheap one."""
    if any(c.cost_usd >= 0.15 and c.confidence >= 0.78 for c in revealed):
        return True
    groups = defaultdict(list)
    for c in revealed:
        groups[_key(benchmark, c)].append(c)
    return any(
        len(g) >= 2 and any(c.cost_usd >= 0.02 for c in g) and all(c.confidence > 0.7 for c in g)
        for g in groups.values()
    )


def _objective(questions, stop, cost_per_usd):
    values = []
    for q in questions:
        for perm in q.permutations:
            revealed = []
            for index in perm:
                if stop(q.benchmark, revealed):
                    break
                revealed.append(q.candidates[index])
            acc = _submit(q.benchmark, revealed, q)
            values.append(acc - cost_per_usd * sum(c.cost_usd for c in revealed))
    return statistics.mean(values)


@pytest.mark.parametrize("benchmark", ["gpqa", "lcb"])
def test_adaptive_spending_beats_exploring_none_and_all(sample, benchmark):
    questions = sample[(benchmark, "train")]
    cost_per_usd = RewardConfig().cost_per_usd
    none = _objective(questions, lambda b, r: True, cost_per_usd)
    everything = _objective(questions, lambda b, r: False, cost_per_usd)
    fixed = [_objective(questions, lambda b, r, k=k: len(r) >= k, cost_per_usd) for k in range(1, 9)]
    adaptive = _objective(questions, _adaptive_stop, cost_per_usd)
    assert adaptive > max([none, everything, *fixed]) + 0.02, (adaptive, none, everything, fixed)
