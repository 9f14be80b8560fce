"""The question loader: round trips, column mapping, and every kind of bad file refused by name."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from atlas_lightning.config import DataConfig
from atlas_lightning.questions.loader import DataError, load_questions, load_split, write_questions
from atlas_lightning.questions.rows import question_to_row
from atlas_lightning.demo.sample import generate_questions
from atlas_lightning.questions.schema import Candidate, Question


@pytest.fixture(scope="module")
def gpqa_questions():
    return generate_questions("gpqa", "train", 20, seed=3)


def _rows(questions):
    return [question_to_row(q) for q in questions]


def _write_rows(root, rows, benchmark="gpqa", split="train", schema=None):
    path = root / benchmark / f"{split}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def _refused(root, match, benchmark="gpqa", split="train", **kwargs):
    with pytest.raises(DataError, match=match) as info:
        load_questions(root, benchmark, split, **kwargs)
    return str(info.value)


# ----------------------------------------------------------------------------- round trips


def test_written_questions_load_back_equal(tmp_path, gpqa_questions):
    write_questions(tmp_path / "gpqa" / "train.parquet", gpqa_questions)
    assert load_questions(tmp_path, "gpqa", "train") == gpqa_questions
    assert [p.name for p in (tmp_path / "gpqa").iterdir()] == ["train.parquet"]  # no temp file left


_text = st.text(max_size=40)
_candidate = st.builds(
    Candidate,
    answer=_text,
    approach=_text,
    confidence=st.floats(0.0, 1.0),
    cost_usd=st.floats(0.0, 1e3),
    is_correct=st.booleans(),
    solver_model=st.text(min_size=1, max_size=20).filter(str.strip),
)


@st.composite
def _question_lists(draw):
    count = draw(st.integers(1, 4))
    questions = []
    for index in range(count):
        candidates = tuple(draw(st.lists(_candidate, min_size=1, max_size=5)))
        perms = draw(st.lists(st.permutations(range(len(candidates))), max_size=3))
        questions.append(
            Question(
                question_id=f"q{index}-" + draw(st.text(max_size=8)),
                benchmark="lcb",
                problem=draw(st.text(min_size=1, max_size=60).filter(str.strip)),
                ground_truth=draw(_text),
                candidates=candidates,
                data_source=draw(_text),
                subsets={"subset": draw(_text), "level": draw(_text)},
                permutations=tuple(tuple(p) for p in perms),
            )
        )
    return questions


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(questions=_question_lists())
def test_any_valid_questions_round_trip(tmp_path, questions):
    write_questions(tmp_path / "lcb" / "train.parquet", questions)
    loaded = load_questions(tmp_path, "lcb", "train", subset_columns=("subset", "level"))
    assert loaded == questions


def test_write_is_deterministic(tmp_path, gpqa_questions):
    write_questions(tmp_path / "a.parquet", gpqa_questions)
    write_questions(tmp_path / "b.parquet", gpqa_questions)
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()


# ----------------------------------------------------------------------------- column mapping


def test_column_mapping_with_dotted_candidate_fields(tmp_path, gpqa_questions):
    rows = []
    for row in _rows(gpqa_questions):
        row["id"] = row.pop("question_id")
        row["cands"] = [
            {("price_usd" if k == "cost_usd" else "model" if k == "solver_model" else k): v for k, v in c.items()}
            for c in row.pop("candidates")
        ]
        row["domain"] = row.pop("subset")
        rows.append(row)
    _write_rows(tmp_path, rows)
    columns = {
        "question_id": "id",
        "candidates": "cands",
        "candidates.cost_usd": "price_usd",
        "candidates.solver_model": "model",
        "subset": "domain",
    }
    assert load_questions(tmp_path, "gpqa", "train", columns=columns) == gpqa_questions

    message = _refused(tmp_path, "field candidates.cost_usd", columns={**columns, "candidates.cost_usd": "usd"})
    assert "'usd'" in message and "price_usd" in message  # names the mapped field and what exists
    _refused(tmp_path, r"data.columns: unknown column 'candidates.price'", columns={"candidates.price": "x"})
    _refused(tmp_path, r"gpqa/train.parquet field question_id \(mapped to 'qid'\): missing column", columns={"question_id": "qid"})


def test_subset_columns_present_are_read_and_absent_skipped(tmp_path, gpqa_questions):
    rows = _rows(gpqa_questions)
    for index, row in enumerate(rows):
        row["tier"] = "hard" if index % 2 else "easy"
    _write_rows(tmp_path, rows)
    loaded = load_questions(tmp_path, "gpqa", "train", subset_columns=("subset", "tier", "not_in_file"))
    assert [q.subsets for q in loaded[:2]] == [
        {"subset": gpqa_questions[0].subsets["subset"], "tier": "easy"},
        {"subset": gpqa_questions[1].subsets["subset"], "tier": "hard"},
    ]
    assert all(q.subsets == {} for q in load_questions(tmp_path, "gpqa", "train", subset_columns=()))



def _split_files(root, gpqa_questions, tier_in=(), without_subset=False):
    """gpqa's train and val_full files (the same questions under ids of their split: a question in
    both is refused); ``tier_in``: the splits whose file has a ``tier`` column."""
    for split in ("train", "val_full"):
        rows = _rows(gpqa_questions)
        for index, row in enumerate(rows):
            row["question_id"] = f"{split}-{row['question_id']}"
            if split in tier_in:
                row["tier"] = "hard" if index % 2 else "easy"
            if without_subset:
                del row["subset"]
        _write_rows(root, rows, split=split)
    return OmegaConf.structured(DataConfig(root=str(root), benchmarks=["gpqa"], val_split="val_full"))


@pytest.mark.parametrize("subset_columns, columns, named", [
    (["level"], {}, "'level'"),
    (["subset", "teir"], {}, "'teir'"),
    (["subset", "tier", "level"], {}, "'level'"),
    (["subset"], {"subset": "category"}, "'subset' (mapped to 'category' by data.columns)"),
])
def test_a_subset_column_no_file_of_the_run_has_is_refused(tmp_path, gpqa_questions, subset_columns, columns, named):
    """A subset column the user named (any but the default ``subset``, or ``subset`` renamed by
    ``data.columns``) that no question file of the run has would give validation no view of it,
    silently: refused naming the key, the column and the files."""
    from atlas_lightning.questions.loader import load_splits

    cfg = _split_files(tmp_path, gpqa_questions, tier_in=("val_full",))
    cfg.subset_columns, cfg.columns = subset_columns, columns
    with pytest.raises(DataError) as refused:
        load_splits(cfg)
    message = str(refused.value)
    assert message.startswith(f"data.subset_columns={subset_columns}: no question file of the run has the column "
                              f"{named} (under data.root={tmp_path}: gpqa/train.parquet, gpqa/val_full.parquet)")


@pytest.mark.parametrize("subset_columns, tier_in, without_subset", [
    (["subset"], (), True),  # the default: optional, data may have no subsets
    (["subset", "tier"], ("val_full",), True),  # in one file of the run is enough
    (["tier"], ("train",), False),
    ([], (), False),
])
def test_subset_columns_some_file_has_and_the_default_pass(tmp_path, gpqa_questions, subset_columns, tier_in,
                                                            without_subset):
    from atlas_lightning.questions.loader import load_splits

    cfg = _split_files(tmp_path, gpqa_questions, tier_in=tier_in, without_subset=without_subset)
    cfg.subset_columns = subset_columns
    splits = load_splits(cfg)
    assert len(splits.train) == len(gpqa_questions) and splits.val


def test_a_subset_column_no_file_has_exits_2_before_anything_is_written(tmp_path, sample_data_dir,
                                                                       orchestrator_dir, capsys):
    from atlas_lightning.cli import main

    root = tmp_path / "root"
    for override in ("data.subset_columns=[levle]", "+data.columns={subset:category}"):
        assert main(["fit", "experiment=tiny-cpu", f"paths.root={root}", f"data.root={sample_data_dir}",
                     f"model.path={orchestrator_dir}", override]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "data.subset_columns=" in err[0] and "no question file of the run has" in err[0]
        assert not root.exists()

def test_optional_columns_may_be_absent(tmp_path, gpqa_questions):
    rows = _rows(gpqa_questions)
    for row in rows:
        del row["permutations"], row["data_source"], row["subset"]
    _write_rows(tmp_path, rows)
    loaded = load_questions(tmp_path, "gpqa", "train")
    assert loaded[0].permutations == () and loaded[0].data_source == "" and loaded[0].subsets == {}
    assert loaded[0].candidates == gpqa_questions[0].candidates


# ----------------------------------------------------------------------------- bad files


def test_nan_cost_names_file_row_question_and_field(tmp_path, gpqa_questions):
    rows = _rows(gpqa_questions)
    rows[17]["candidates"][3]["cost_usd"] = math.nan
    _write_rows(tmp_path, rows)
    message = _refused(tmp_path, "NaN")
    assert message == "gpqa/train.parquet row 17 (question_id=gpqa-train-0017) field candidates[3].cost_usd: NaN"


@pytest.mark.parametrize(
    ("row", "mutate", "expected"),
    [
        (4, lambda r: r["candidates"][1].update(cost_usd=-0.01), r"row 4 \(question_id=gpqa-train-0004\) field candidates\[1\]\.cost_usd: negative \(-0\.01\)"),
        (2, lambda r: r["candidates"][0].update(cost_usd=math.inf), r"row 2 .* field candidates\[0\]\.cost_usd: infinite"),
        (5, lambda r: r.update(candidates=[]), r"row 5 .* field candidates: empty list"),
        (6, lambda r: r["candidates"][7].update(confidence=1.5), r"row 6 .* field candidates\[7\]\.confidence: 1\.5 is above 1"),
        (7, lambda r: r["candidates"][2].update(answer=None), r"row 7 .* field candidates\[2\]\.answer: missing \(null\)"),
        (8, lambda r: r.update(problem="  "), r"row 8 .* field problem: empty string"),
        (9, lambda r: r.update(benchmark="mmlu"), r"row 9 .* field benchmark: unknown benchmark 'mmlu' \(known: gpqa, lcb\)"),
        (10, lambda r: r.update(benchmark="lcb"), r"row 10 .* field benchmark: 'lcb' in a gpqa file"),
        (11, lambda r: r.update(ground_truth="(B)"), r"row 11 .* field ground_truth: GPQA needs one capital letter"),
        (12, lambda r: r.update(permutations=[list(range(8)), [0, 1, 2, 3, 4, 5, 6, 6]]), r"row 12 .* field permutations\[1\]: \[0, 1, 2, 3, 4, 5, 6, 6\] is not a permutation of range\(8\)"),
        (13, lambda r: r.update(permutations=[[2, 1, 0]]), r"row 13 .* field permutations\[0\]: \[2, 1, 0\] is not a permutation of range\(8\)"),
        (14, lambda r: r.update(question_id=None), r"row 14 \(question_id=\?\) field question_id: missing \(null\)"),
        (15, lambda r: r.update(subset=None), r"row 15 .* field subset: missing \(null\)"),
    ],
)
def test_bad_value_is_refused_with_row_and_field(tmp_path, gpqa_questions, row, mutate, expected):
    rows = _rows(gpqa_questions)
    mutate(rows[row])
    _write_rows(tmp_path, rows)
    message = _refused(tmp_path, expected)
    assert message.startswith("gpqa/train.parquet row ")


def test_duplicate_question_id_names_both_rows(tmp_path, gpqa_questions):
    rows = _rows(gpqa_questions)
    rows[9]["question_id"] = rows[3]["question_id"]
    _write_rows(tmp_path, rows)
    _refused(tmp_path, r"^gpqa/train.parquet row 9 \(question_id=gpqa-train-0003\) field question_id: duplicate of row 3$")


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        # A whole column of the wrong type: the first row is named.
        (lambda r: [c.update(cost_usd=str(c["cost_usd"])) for c in r["candidates"]], r"row 0 .* field candidates\[0\]\.cost_usd: expected a number, got str '0\.\d+'"),
        (lambda r: [c.update(is_correct=int(c["is_correct"])) for c in r["candidates"]], r"row 0 .* field candidates\[0\]\.is_correct: expected a bool, got int"),
        (lambda r: r.update(problem=len(r["problem"])), r"row 0 .* field problem: expected a string, got int"),
        (lambda r: r.update(candidates="A"), r"row 0 .* field candidates: expected a list of structs, got str"),
        (lambda r: r.update(permutations=[[float(i) for i in p] for p in r["permutations"]]), r"row 0 .* field permutations\[0\]: expected a list of ints"),
    ],
)
def test_wrong_column_type_is_refused(tmp_path, gpqa_questions, mutate, expected):
    rows = _rows(gpqa_questions)
    for row in rows:
        mutate(row)
    _write_rows(tmp_path, rows)
    _refused(tmp_path, "^gpqa/train.parquet " + expected)


def test_missing_column_and_missing_struct_field(tmp_path, gpqa_questions):
    rows = _rows(gpqa_questions)
    for row in rows:
        del row["problem"]
    _write_rows(tmp_path, rows)
    message = _refused(tmp_path, r"^gpqa/train.parquet field problem: missing column; the file has ")
    assert "question_id" in message

    rows = _rows(gpqa_questions)
    for row in rows:
        for candidate in row["candidates"]:
            del candidate["cost_usd"]
    _write_rows(tmp_path, rows)
    _refused(tmp_path, r"^gpqa/train.parquet field candidates.cost_usd: missing from the candidate struct")


def test_truncated_empty_and_absent_files(tmp_path, gpqa_questions):
    path = _write_rows(tmp_path, _rows(gpqa_questions))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _refused(tmp_path, r"^gpqa/train.parquet: not a readable parquet file")
    path.write_bytes(b"")
    _refused(tmp_path, r"^gpqa/train.parquet: not a readable parquet file")

    schema = pa.Table.from_pylist(_rows(gpqa_questions)).schema
    _write_rows(tmp_path, [], schema=schema)
    _refused(tmp_path, r"^gpqa/train.parquet: no questions \(0 rows\)")

    _refused(tmp_path, r"^lcb/val_full.parquet: no such file", benchmark="lcb", split="val_full")
    (tmp_path / "lcb" / "val_full.parquet").mkdir(parents=True)
    _refused(tmp_path, r"^lcb/val_full.parquet: a folder, not a parquet file", benchmark="lcb", split="val_full")


def test_unknown_benchmark_and_bad_split(tmp_path):
    _refused(tmp_path, r"unknown benchmark 'mmlu' \(known: gpqa, lcb\)", benchmark="mmlu")
    _refused(tmp_path, r"split '../train'", split="../train")


# ----------------------------------------------------------------------------- load_split


def test_load_split_orders_benchmarks_as_configured_and_caps(tmp_path):
    gpqa = generate_questions("gpqa", "val_full", 5, seed=1)
    lcb = generate_questions("lcb", "val_full", 4, seed=1)
    write_questions(tmp_path / "gpqa" / "val_full.parquet", gpqa)
    write_questions(tmp_path / "lcb" / "val_full.parquet", lcb)

    cfg = OmegaConf.structured(DataConfig(root=str(tmp_path), benchmarks=["lcb", "gpqa"]))
    assert load_split(cfg, cfg.val_split) == lcb + gpqa
    assert load_split(cfg, "val_full", max_per_benchmark=2) == lcb[:2] + gpqa[:2]

    plain = SimpleNamespace(root=tmp_path, benchmarks=["gpqa"], columns=None, subset_columns=None)
    assert [q.subsets for q in load_split(plain, "val_full")] == [{}] * 5
    with pytest.raises(DataError, match="data.benchmarks: gpqa listed twice"):
        load_split(SimpleNamespace(root=tmp_path, benchmarks=["gpqa", "gpqa"], columns={}, subset_columns=[]), "val_full")
    with pytest.raises(DataError, match="lcb/train.parquet: no such file"):
        load_split(cfg, "train")


# ----------------------------------------------------------------------------- write_questions


def test_write_refuses_bad_questions_and_keeps_the_old_file(tmp_path, gpqa_questions):
    path = tmp_path / "gpqa" / "train.parquet"
    write_questions(path, gpqa_questions)
    before = path.read_bytes()

    bad = list(gpqa_questions)
    first = bad[4].candidates[0]
    bad[4] = Question(**{**bad[4].__dict__, "candidates": (Candidate(**{**first.__dict__, "cost_usd": math.nan}),) + bad[4].candidates[1:]})
    with pytest.raises(DataError, match=re.escape("train.parquet item 4 (question_id=gpqa-train-0004) field candidates[0].cost_usd: NaN")):
        write_questions(path, bad)

    mixed = list(gpqa_questions)
    mixed[2] = Question(**{**mixed[2].__dict__, "subsets": {"other": "x"}})
    with pytest.raises(DataError, match=r"item 2 .* field subsets: has \['other'\], item 0 has \['subset'\]"):
        write_questions(path, mixed)

    duplicated = list(gpqa_questions) + [gpqa_questions[0]]
    with pytest.raises(DataError, match=r"item 20 .* field question_id: duplicate of item 0"):
        write_questions(path, duplicated)

    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["train.parquet"]
