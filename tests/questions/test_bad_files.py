"""Question files that would train on the wrong thing are refused naming file, row and field:
a GPQA answer that is not one of the problem's letters, bytes that are not UTF-8 in any string
column, two ids the rollout layer would name alike, costs whose reward cannot be finite."""

from __future__ import annotations

import math
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from atlas_lightning.demo.sample import generate_questions
from atlas_lightning.questions.loader import DataError, load_questions, write_questions
from atlas_lightning.questions.rows import choice_letters, question_to_row
from atlas_lightning.questions.schema import MAX_COST_USD
from atlas_lightning.questions.uid import trajectory_uid
from atlas_lightning.reward import RewardError, reward_breakdown


@pytest.fixture(scope="module")
def gpqa():
    return generate_questions("gpqa", "train", 6, seed=4)


@pytest.fixture(scope="module")
def lcb():
    return generate_questions("lcb", "train", 4, seed=4)


def _write(root, rows, benchmark="gpqa", table=None):
    path = root / benchmark / "train.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table if table is not None else pa.Table.from_pylist(rows), path)
    return path


def _refused(root, benchmark="gpqa"):
    with pytest.raises(DataError) as info:
        load_questions(root, benchmark, "train")
    return str(info.value)


# -- GPQA letters ---------------------------------------------------------------------------


@pytest.mark.parametrize("problem, letters", [
    ("Which?\n\nA) 1\nB) 2\nC) 3\nD) 4", "ABCD"),
    ("Which?\n(A) 1\n(B) 2\n(C) 3", "ABC"),
    ("Which?\na. one\nb. two", "AB"),
    ("Which?\nA: one\nB: two\nC: three\nD: four\nE: five", "ABCDE"),
    ("Statements:\nI. x\nII. y\nA) I only\nB) II only", "AB"),
    ("Pick one: (A) 2 atm (B) 3 atm (C) 4 atm", "ABC"),
    ("No choices at all", ""),
    ("B) starts at B\nC) and C", ""),
])
def test_choice_letters_are_the_run_from_A(problem, letters):
    assert choice_letters(problem) == letters


@pytest.mark.parametrize("truth", ["E", "Z"])
def test_a_ground_truth_outside_the_problems_letters_is_refused(tmp_path, gpqa, truth):
    rows = [question_to_row(q) for q in gpqa]
    rows[3]["ground_truth"] = truth
    _write(tmp_path, rows)
    message = _refused(tmp_path)
    assert message.startswith(f"gpqa/train.parquet row 3 (question_id={gpqa[3].question_id}) field ground_truth:")
    assert f"{truth!r} is not one of the problem's choices (A, B, C, D)" in message


def test_a_gpqa_problem_without_lettered_choices_is_refused(tmp_path, gpqa):
    rows = [question_to_row(q) for q in gpqa]
    rows[1]["problem"] = "What is the pressure of the gas?"
    _write(tmp_path, rows)
    assert "row 1 " in _refused(tmp_path) and "field problem: shows no lettered choices" in _refused(tmp_path)


@pytest.mark.parametrize("change", ["truth_moves", "candidate_flips_wrong", "candidate_flips_right"])
def test_a_ground_truth_that_contradicts_its_candidates_is_refused_or_kept_by_name(tmp_path, gpqa, change):
    rows = [question_to_row(q) for q in gpqa]
    row = rows[2]
    right = next(k for k, c in enumerate(row["candidates"]) if c["is_correct"])
    wrong = next(k for k, c in enumerate(row["candidates"]) if not c["is_correct"])
    if change == "truth_moves":  # another choice, as a mislabelled row would say
        row["ground_truth"] = next(letter for letter in "ABCD" if letter != row["ground_truth"])
    else:
        row["candidates"][right if change == "candidate_flips_wrong" else wrong]["is_correct"] = \
            change == "candidate_flips_right"
    _write(tmp_path, rows)
    message = _refused(tmp_path)
    assert message.startswith(f"gpqa/train.parquet row 2 (question_id={gpqa[2].question_id}) field candidates[")
    assert ".is_correct: " in message and "contradicts ground_truth" in message
    assert "data.label_conflicts=keep" in message
    kept = load_questions(tmp_path, "gpqa", "train", label_conflicts="keep")
    assert kept[2].ground_truth == row["ground_truth"]


def test_every_sample_question_passes(gpqa, tmp_path):
    write_questions(tmp_path / "gpqa" / "train.parquet", gpqa)
    assert load_questions(tmp_path, "gpqa", "train") == gpqa


# -- UTF-8 ------------------------------------------------------------------------------------


def _with_bytes(rows, column, row, raw: bytes, field=None, candidate=0):
    """A table equal to ``rows`` except that one string holds ``raw`` (not UTF-8)."""
    table = pa.Table.from_pylist(rows)
    index = table.column_names.index(column)
    if field is None:
        values = [r[column].encode() for r in rows]
        values[row] = raw
        array = pa.array(values, type=pa.binary()).view(pa.string())
    else:
        kind = table.schema.field(column).type
        binary_kind = pa.list_(pa.struct([(f.name, pa.binary() if pa.types.is_string(f.type) else f.type)
                                          for f in kind.value_type]))
        values = [[{k: (v.encode() if isinstance(v, str) else v) for k, v in c.items()} for c in r[column]]
                  for r in rows]
        values[row][candidate][field] = raw
        array = pa.array(values, type=binary_kind).view(kind)
    return table.set_column(index, column, array)


@pytest.mark.parametrize("column, field, named", [
    ("problem", None, "field problem"),
    ("question_id", None, "field question_id"),
    ("ground_truth", None, "field ground_truth"),
    ("data_source", None, "field data_source"),
    ("subset", None, "field subset"),
    ("candidates", "answer", "field candidates[2].answer"),
    ("candidates", "approach", "field candidates[2].approach"),
    ("candidates", "solver_model", "field candidates[2].solver_model"),
])
def test_invalid_utf8_in_any_string_column_names_file_row_and_field(tmp_path, gpqa, column, field, named):
    rows = [question_to_row(q) for q in gpqa]
    _write(tmp_path, None, table=_with_bytes(rows, column, 4, b"ok \xff\xfe broken", field=field, candidate=2))
    message = _refused(tmp_path)
    assert re.match(r"gpqa/train\.parquet row 4 \(question_id=(\?|gpqa-\S+)\) ", message), message
    assert named + ": not valid UTF-8 (byte(s) ff at byte 3" in message


def test_invalid_utf8_in_a_renamed_candidate_field_uses_our_name(tmp_path, gpqa):
    rows = [question_to_row(q) for q in gpqa]
    for row in rows:
        for c in row["candidates"]:
            c["text"] = c.pop("answer")
    _write(tmp_path, None, table=_with_bytes(rows, "candidates", 0, b"\xc3", field="text", candidate=1))
    with pytest.raises(DataError, match=r"row 0 .* field candidates\[1\]\.answer: not valid UTF-8"):
        load_questions(tmp_path, "gpqa", "train", columns={"candidates.answer": "text"})


# -- uids as the rollout layer forms them -------------------------------------------------------


@pytest.mark.parametrize("ids", [("7", "gpqa-7"), ("a b", "a_b-" + trajectory_uid("gpqa", "a b").split("-")[-1])])
def test_ids_that_name_their_trajectories_alike_are_refused(tmp_path, gpqa, ids):
    rows = [question_to_row(q) for q in gpqa]
    rows[1]["question_id"], rows[4]["question_id"] = ids
    if trajectory_uid("gpqa", ids[0]) != trajectory_uid("gpqa", ids[1]):
        pytest.skip("not a collision under this uid rule")
    _write(tmp_path, rows)
    message = _refused(tmp_path)
    assert message.startswith(f"gpqa/train.parquet row 4 (question_id={ids[1]}) field question_id:")
    assert f"as those of row 1 (question_id={ids[0]})" in message


def test_writing_refuses_the_same_collision(tmp_path, gpqa):
    from dataclasses import replace

    clash = [replace(gpqa[0], question_id="7"), replace(gpqa[1], question_id="gpqa-7")]
    with pytest.raises(DataError, match=r"item 1 \(question_id=gpqa-7\) field question_id: .*'gpqa-7'"):
        write_questions(tmp_path / "gpqa" / "train.parquet", clash)


def test_the_datamodule_names_trajectories_with_the_loaders_rule(gpqa):
    from atlas_lightning.rollout import datamodule, step_questions

    assert datamodule.trajectory_key is step_questions.trajectory_key  # one rule for records and resumes
    question = gpqa[0]
    uid, session = step_questions.trajectory_key(question, 3)
    assert uid == trajectory_uid(question.benchmark, question.question_id)
    assert session != step_questions.trajectory_key(question, 2)[1]


# -- costs and the reward ------------------------------------------------------------------------


@pytest.mark.parametrize("cost", [1e308, MAX_COST_USD * 1.0001])
def test_costs_too_large_for_a_finite_reward_are_refused(tmp_path, lcb, cost):
    rows = [question_to_row(q) for q in lcb]
    rows[2]["candidates"][5]["cost_usd"] = cost
    _write(tmp_path, rows, benchmark="lcb")
    message = _refused(tmp_path, "lcb")
    assert message.startswith(f"lcb/train.parquet row 2 (question_id={lcb[2].question_id}) "
                              f"field candidates[5].cost_usd: {cost} is above")


def test_the_largest_allowed_costs_give_a_finite_float32_reward():
    episode = _episode([MAX_COST_USD] * 64)
    reward = reward_breakdown(episode, cost_per_usd=1e6)
    assert math.isfinite(reward["final_reward"]) and abs(reward["final_reward"]) < 3.4e38


def test_the_reward_refuses_an_overflow_by_name():
    with pytest.raises(RewardError, match=r"question_id='q-9' sample 3: the reward overflows"):
        reward_breakdown(_episode([1e308, 1e308, 1e308]), cost_per_usd=1.0)
    with pytest.raises(RewardError, match=r"field cost_total=1e\+300 is not finite in float32"):
        reward_breakdown(_episode([1e300]), cost_per_usd=1e10)


def _episode(costs):
    """A scored-by-hand episode: ``len(costs)`` explores, then a terminal without submit."""
    events, offset = [], 0
    for k, cost in enumerate(costs, start=1):
        events.append({"type": "explore", "turn": k, "explore_k": k, "candidate_idx": k - 1,
                       "offsets": [offset, offset + 2], "charged_cost_usd": cost, "is_correct": False,
                       "tool_response": "", "tool_response_offsets": [offset + 2, offset + 3]})
        offset += 3
    events.append({"type": "terminal", "turn": len(costs) + 1, "terminal_reason": "no_tool_call",
                   "terminal_reason_code": 1, "last_generated": offset + 1})
    return {"question_id": "q-9", "sample_index": 3, "max_explores": max(8, len(costs)), "max_turns": 99,
            "num_turns": len(costs) + 1, "events": events, "generations": [], "terminal_reason": "no_tool_call"}
