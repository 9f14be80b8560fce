"""Read and write question parquets: ``<root>/<benchmark>/<split>.parquet`` (README, "Question data").

The column schema is documented in ``schema.py``. Files named differently are read through a
column mapping, ``data.columns`` in the config: *our name -> the file's name*. Keys are

- a top-level column: ``question_id``, ``benchmark``, ``problem``, ``ground_truth``,
  ``candidates``, ``data_source``, ``permutations``, or any of ``data.subset_columns``;
- a field of the candidate structs, dotted: ``candidates.cost_usd: price_usd`` reads the struct
  field ``price_usd`` of the (possibly renamed) candidates column as our ``cost_usd``.

Unmapped names are read as they are. Extra columns in a file are ignored. A subset column
(``data.subset_columns``, default ``[subset]``) that the file lacks is skipped: validation shows
the subset views of the columns the data has. Every other problem is a ``DataError`` naming the
file, and for a bad value the row and the field::

    gpqa/train.parquet row 17 (question_id=gpqa-0017) field candidates[3].cost_usd: NaN

Who calls it: the run's start-up (``load_splits``: ``run/facts.py`` loads the splits once, the
RolloutDataModule takes them), pre-flight, the sample builder and tests (``write_questions``),
the CLI's ``data`` verbs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from atlas_lightning.errors import quoted
from atlas_lightning.questions.rows import DataError, question_from_row, question_to_row
from atlas_lightning.questions.uid import trajectory_uid
from atlas_lightning.questions.schema import (
    BENCHMARKS,
    CANDIDATE_FIELDS,
    OPTIONAL_COLUMNS,
    REQUIRED_COLUMNS,
    Candidate,
    Question,
)

__all__ = ["DataError", "QuestionSplits", "load_questions", "load_split", "load_splits", "write_questions",
           "question_file"]

_CANDIDATE_TYPE = pa.struct(
    [
        ("answer", pa.string()),
        ("approach", pa.string()),
        ("confidence", pa.float64()),
        ("cost_usd", pa.float64()),
        ("is_correct", pa.bool_()),
        ("solver_model", pa.string()),
    ]
)


def question_file(root: str | os.PathLike, benchmark: str, split: str) -> Path:
    """``<root>/<benchmark>/<split>.parquet``; refuses an unknown benchmark or a split with a path in it."""
    if benchmark not in BENCHMARKS:
        raise DataError(f"unknown benchmark {benchmark!r} (known: {', '.join(BENCHMARKS)})")
    if not split or "/" in split or "\\" in split or split.startswith("."):
        raise DataError(f"split {split!r} must be a plain file stem such as 'train' or 'val_full'")
    return Path(root) / benchmark / f"{split}.parquet"


def _check_mapping(columns: Mapping[str, str], subset_columns: Sequence[str]) -> dict[str, str]:
    known = set(REQUIRED_COLUMNS) | set(OPTIONAL_COLUMNS) | set(subset_columns)
    known |= {f"candidates.{name}" for name in CANDIDATE_FIELDS}
    mapping = {}
    for ours, theirs in columns.items():
        if ours not in known:
            raise DataError(
                f"data.columns: unknown column {ours!r}; known: {', '.join(sorted(known))}"
            )
        if not isinstance(theirs, str) or not theirs.strip():
            raise DataError(f"data.columns.{ours}: expected the file's column name, got {theirs!r}")
        mapping[str(ours)] = theirs
    return mapping


def _read_table(path: Path, label: str) -> pa.Table:
    if not path.is_file():
        raise DataError(f"{label}: {'a folder, not a parquet file' if path.is_dir() else 'no such file'} ({path})")
    try:
        return pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{label}: not a readable parquet file ({quoted(str(err))})") from None


def _binary_type(kind: pa.DataType) -> pa.DataType:
    """``kind`` with every string replaced by binary of the same layout (for a zero-copy view)."""
    if pa.types.is_string(kind):
        return pa.binary()
    if pa.types.is_large_string(kind):
        return pa.large_binary()
    if pa.types.is_list(kind):
        return pa.list_(pa.field(kind.value_field.name, _binary_type(kind.value_type)))
    if pa.types.is_large_list(kind):
        return pa.large_list(pa.field(kind.value_field.name, _binary_type(kind.value_type)))
    if pa.types.is_struct(kind):
        return pa.struct([pa.field(kind.field(i).name, _binary_type(kind.field(i).type)) for i in range(kind.num_fields)])
    return kind


def _undecodable(value: Any, path: str, rename: Mapping[str, str]) -> tuple[str, UnicodeDecodeError] | None:
    """The first place in a row's raw value (bytes where the file has strings) that is not UTF-8;
    struct fields are named through ``rename`` (the file's name -> ours)."""
    if isinstance(value, bytes):
        try:
            value.decode("utf-8")
        except UnicodeDecodeError as err:
            return path, err
    elif isinstance(value, dict):
        for key, item in value.items():
            found = _undecodable(item, f"{path}.{rename.get(key, key)}", rename)
            if found:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = _undecodable(item, f"{path}[{index}]", rename)
            if found:
                return found
    return None


def _column_values(table: pa.Table, column: str, ours: str, label: str, rename: Mapping[str, str] | None = None) -> list:
    """``table.column(column).to_pylist()``; a string that is not valid UTF-8, anywhere in the
    column (nested candidate fields included), is a ``DataError`` naming the row and the field
    (``candidates[2].answer``: our names, through ``rename`` for struct fields)."""
    data = table.column(column)
    try:
        return data.to_pylist()
    except UnicodeDecodeError:
        pass
    raw = pa.chunked_array([chunk.view(_binary_type(data.type)) for chunk in data.chunks],
                           type=_binary_type(data.type)).to_pylist()
    for index, value in enumerate(raw):
        found = _undecodable(value, ours, rename or {})
        if found is None:
            continue
        path, err = found
        try:
            question_id = table.column("question_id")[index].as_py() if "question_id" in table.column_names else "?"
        except UnicodeDecodeError:
            question_id = "?"
        bad = err.object[err.start:err.end]
        raise DataError(f"{label} row {index} (question_id={question_id}) field {path}: not valid UTF-8 "
                        f"(byte(s) {bad.hex(' ')} at byte {err.start}: {err.reason})")
    raise DataError(f"{label} field {ours}: not valid UTF-8")  # pyarrow refused, yet no row fails: still name it


def _rename_candidate_fields(
    table: pa.Table, column: str, mapping: dict[str, str], label: str
) -> list[dict[str, Any]] | None:
    """The candidates column as Python lists of dicts keyed by our field names.

    Missing struct fields are refused here, for the whole file; values are checked per row later.
    Returns ``None`` when the column is not ``list<struct>`` (the row check then names the row).
    """
    kind = table.schema.field(column).type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_struct(kind.value_type):
        return None
    present = {kind.value_type.field(i).name for i in range(kind.value_type.num_fields)}
    for ours in CANDIDATE_FIELDS:
        theirs = mapping.get(f"candidates.{ours}", ours)
        if theirs not in present:
            renamed = f" (mapped to {theirs!r})" if theirs != ours else ""
            raise DataError(
                f"{label} field candidates.{ours}{renamed}: missing from the candidate struct, "
                f"which has {', '.join(sorted(present))}"
            )
    rename = {mapping.get(f"candidates.{ours}", ours): ours for ours in CANDIDATE_FIELDS}
    rows = _column_values(table, column, "candidates", label, rename)
    return [
        None if cands is None else [
            None if c is None else {rename[k]: v for k, v in c.items() if k in rename} for c in cands
        ]
        for cands in rows
    ]


def load_questions(
    root: str | os.PathLike,
    benchmark: str,
    split: str,
    columns: Mapping[str, str] | None = None,
    subset_columns: Sequence[str] = ("subset",),
    label_conflicts: str = "refuse",
) -> list[Question]:
    """All questions of ``<root>/<benchmark>/<split>.parquet``, in file order, every value checked.

    ``columns``: our name -> the file's column name (see the module docstring).
    ``subset_columns``: our names of the subset columns; those absent from the file are skipped.
    Raises ``DataError`` naming the file (and row and field for a bad value): missing file,
    unreadable or truncated parquet, missing column, wrong type, null, a string that is not valid
    UTF-8, NaN, negative or huge cost (above ``schema.MAX_COST_USD``), confidence outside [0, 1],
    empty candidate list, duplicate question id or two ids that name their trajectories alike
    (``uid.trajectory_uid``), a GPQA ``ground_truth`` that is not one of the problem's choice
    letters, a GPQA candidate whose ``is_correct`` contradicts the ground truth (unless
    ``label_conflicts`` is ``keep``: ``rows.LABEL_CONFLICT_POLICIES``), a row of another or unknown
    benchmark, a permutation that is not one of ``range(len(candidates))``, an empty file.
    """
    path = question_file(root, benchmark, split)
    label = f"{benchmark}/{split}.parquet"
    subset_columns = tuple(subset_columns)
    mapping = _check_mapping(dict(columns or {}), subset_columns)
    table = _read_table(path, label)
    names = set(table.column_names)
    if len(names) != len(table.column_names):
        twice = sorted({n for n in table.column_names if table.column_names.count(n) > 1})
        raise DataError(f"{label} field {twice[0]}: the file has {len(table.column_names) - len(names) + 1} columns "
                        f"of that name")

    def file_name(ours: str) -> str:
        return mapping.get(ours, ours)

    for ours in REQUIRED_COLUMNS:
        if file_name(ours) not in names:
            renamed = f" (mapped to {file_name(ours)!r})" if file_name(ours) != ours else ""
            raise DataError(
                f"{label} field {ours}{renamed}: missing column; the file has {', '.join(table.column_names)}"
            )
    present_subsets = tuple(name for name in subset_columns if file_name(name) in names)
    wanted = [name for name in (*REQUIRED_COLUMNS, *OPTIONAL_COLUMNS, *present_subsets) if file_name(name) in names]
    wanted = list(dict.fromkeys(wanted))  # "subset" is both optional and a subset column
    if table.num_rows == 0:
        raise DataError(f"{label}: no questions (0 rows)")

    values = {ours: _column_values(table, file_name(ours), ours, label) for ours in wanted if ours != "candidates"}
    candidates = _rename_candidate_fields(table, file_name("candidates"), mapping, label)
    values["candidates"] = (candidates if candidates is not None
                            else _column_values(table, file_name("candidates"), "candidates", label))

    questions: list[Question] = []
    first_row: dict[str, int] = {}
    first_uid: dict[str, tuple[int, str]] = {}
    for index in range(table.num_rows):
        row = {ours: column[index] for ours, column in values.items()}
        question = question_from_row(row, f"{label} row {index}", benchmark, present_subsets, label_conflicts)
        if question.question_id in first_row:
            raise DataError(
                f"{label} row {index} (question_id={question.question_id}) field question_id: "
                f"duplicate of row {first_row[question.question_id]}"
            )
        uid = trajectory_uid(benchmark, question.question_id)
        if uid in first_uid:
            other_row, other_id = first_uid[uid]
            raise DataError(
                f"{label} row {index} (question_id={question.question_id}) field question_id: its trajectories "
                f"would be named {uid!r}, as those of row {other_row} (question_id={other_id}); rename one "
                f"(ids that already start with {benchmark!r} are kept as they are, others get it prefixed)"
            )
        first_row[question.question_id] = index
        first_uid[uid] = (index, question.question_id)
        questions.append(question)
    return questions


def load_split(cfg_data: Any, split: str, max_per_benchmark: int | None = None) -> list[Question]:
    """The questions of ``split`` (a file stem, e.g. ``cfg.data.val_split``) for every benchmark.

    ``cfg_data``: anything with ``root``, ``benchmarks``, ``columns``, ``subset_columns`` (and
    optionally ``label_conflicts``)
    (``DataConfig``, its DictConfig, a namespace). Order is stable: benchmarks in configured order,
    then file order. ``max_per_benchmark`` keeps the first N of each file (e.g.
    ``data.val_max_questions``); None keeps all. Question ids are unique within a benchmark only:
    key questions by ``(benchmark, question_id)``.
    """
    benchmarks = list(cfg_data.benchmarks)
    if not benchmarks:
        raise DataError("data.benchmarks: no benchmark configured")
    repeated = sorted({b for b in benchmarks if benchmarks.count(b) > 1})
    if repeated:
        raise DataError(f"data.benchmarks: {', '.join(repeated)} listed twice")
    if max_per_benchmark is not None and max_per_benchmark <= 0:
        raise DataError(f"max_per_benchmark={max_per_benchmark} must be positive (or None for all)")
    questions: list[Question] = []
    for benchmark in benchmarks:
        loaded = load_questions(
            cfg_data.root,
            benchmark,
            split,
            columns=dict(cfg_data.columns or {}),
            subset_columns=tuple(cfg_data.subset_columns or ()),
            label_conflicts=getattr(cfg_data, "label_conflicts", "refuse"),
        )
        questions.extend(loaded if max_per_benchmark is None else loaded[:max_per_benchmark])
    return questions


@dataclass(frozen=True)
class QuestionSplits:
    """A run's questions: ``train`` (``data.train_split``, all of it) and ``val``
    (``data.val_split``, the first ``data.val_max_questions`` of each benchmark)."""

    train: list[Question]
    val: list[Question]


def load_splits(cfg_data: Any) -> QuestionSplits:
    """The train and validation splits of ``cfg_data`` (``DataConfig``). Every row of every file
    is read and checked, the validation cap included (``load_split``): loading is verifying; the
    subset columns too (``check_subset_columns``)."""
    splits = QuestionSplits(train=load_split(cfg_data, cfg_data.train_split),
                            val=load_split(cfg_data, cfg_data.val_split, cfg_data.val_max_questions))
    check_subset_columns(cfg_data, {cfg_data.train_split: splits.train, cfg_data.val_split: splits.val})
    check_disjoint_splits(cfg_data, splits.train, splits.val)
    return splits


def check_disjoint_splits(cfg_data: Any, train: Sequence[Question], val: Sequence[Question]) -> None:
    """No validation question is a training question: a question id (ids are unique within a
    benchmark) in both ``data.train_split`` and the validation questions the run scores ``val``
    (``load_split``'s questions, in file order, so a question's place in its benchmark's list is
    its row) would be trained on and then scored as unseen, and the validation figures would
    overstate what was learnt. ``DataError`` naming the benchmark, the id, both files with their
    rows and how many more ids are shared, and ``data.split_overlap=allow``, which loads them (a
    user's data may validate on training questions on purpose); both splits naming one file is
    refused as such, whatever the switch."""
    if cfg_data.train_split == cfg_data.val_split:
        raise DataError(f"data.train_split and data.val_split both name {cfg_data.train_split!r}: validation would "
                        f"score the very questions the run trains on; name two different files")
    if getattr(cfg_data, "split_overlap", "refuse") == "allow":
        return
    for benchmark in cfg_data.benchmarks:
        train_rows = {q.question_id: row for row, q in enumerate(q for q in train if q.benchmark == benchmark)}
        shared = [(row, q.question_id) for row, q in enumerate(q for q in val if q.benchmark == benchmark)
                  if q.question_id in train_rows]
        if shared:
            val_row, question_id = shared[0]
            more = f" ({len(shared) - 1} more id(s) of {benchmark} are in both)" if len(shared) > 1 else ""
            raise DataError(
                f"{benchmark}/{cfg_data.train_split}.parquet row {train_rows[question_id]} and "
                f"{benchmark}/{cfg_data.val_split}.parquet row {val_row} (question_id={question_id}) field "
                f"question_id: the same question in the training and the validation split{more}: validation "
                f"would score questions the run trains on; remove them from one of the two files "
                f"(under data.root={cfg_data.root}), or load them as they are with data.split_overlap=allow")


#: The subset column read when ``data.subset_columns`` is left as it is: optional (the bundled
#: sample and a user's data may have no subsets; validation then shows none).
DEFAULT_SUBSET_COLUMN = "subset"


def check_subset_columns(cfg_data: Any, loaded: Mapping[str, Sequence[Question]]) -> None:
    """Every subset column the user named is in at least one of the run's question files.

    ``loaded``: split name -> its questions (``load_split``). A file that lacks a subset column
    skips it (the module doc); but a column that NO file of the run has gives validation no view
    at all, silently: a misspelt name. The default ``subset``, unmapped, stays optional; any other
    name in ``data.subset_columns``, or ``subset`` renamed by ``data.columns``, was named by the
    user and is refused here (``DataError``: the key, the column and the files)."""
    mapping = dict(cfg_data.columns or {})
    present = {name for questions in loaded.values() for question in questions for name in question.subsets}
    missing = [name for name in (cfg_data.subset_columns or ())
               if name not in present and (name != DEFAULT_SUBSET_COLUMN or name in mapping)]
    if missing:
        files = ", ".join(f"{benchmark}/{split}.parquet" for split in loaded for benchmark in cfg_data.benchmarks)
        named = ", ".join(f"{name!r}" + (f" (mapped to {mapping[name]!r} by data.columns)" if name in mapping else "")
                          for name in missing)
        raise DataError(f"data.subset_columns={list(cfg_data.subset_columns)}: no question file of the run has the "
                        f"column {named} (under data.root={cfg_data.root}: {files}); name columns the files have, "
                        f"or map them with data.columns")


def _table(questions: Sequence[Question], where: str) -> pa.Table:
    subset_names = sorted(questions[0].subsets) if questions else []
    reserved = set(REQUIRED_COLUMNS) | (set(OPTIONAL_COLUMNS) - {"subset"})
    for name in subset_names:
        if name in reserved:
            raise DataError(f"{where} item 0 field subsets: {name!r} clashes with a column of the schema")
    rows = []
    first_item: dict[str, int] = {}
    first_uid: dict[str, int] = {}
    for index, question in enumerate(questions):
        if not isinstance(question, Question):
            raise DataError(f"{where} item {index}: expected a Question, got {type(question).__name__}")
        if sorted(question.subsets) != subset_names:
            raise DataError(
                f"{where} item {index} (question_id={question.question_id}) field subsets: has "
                f"{sorted(question.subsets)}, item 0 has {subset_names}; a file has one set of subset columns"
            )
        for k, candidate in enumerate(question.candidates):
            if not isinstance(candidate, Candidate):
                raise DataError(
                    f"{where} item {index} (question_id={question.question_id}) field candidates[{k}]: "
                    f"expected a Candidate, got {type(candidate).__name__}"
                )
        row = question_to_row(question)
        # The same checks as reading, so that every file written here loads.
        question_from_row(row, f"{where} item {index}", question.benchmark, tuple(subset_names))
        if question.question_id in first_item:
            raise DataError(
                f"{where} item {index} (question_id={question.question_id}) field question_id: "
                f"duplicate of item {first_item[question.question_id]}"
            )
        uid = trajectory_uid(question.benchmark, question.question_id)
        if uid in first_uid:
            raise DataError(
                f"{where} item {index} (question_id={question.question_id}) field question_id: its trajectories "
                f"would be named {uid!r}, as those of item {first_uid[uid]}"
            )
        first_item[question.question_id] = index
        first_uid[uid] = index
        rows.append(row)
    schema = pa.schema(
        [
            ("question_id", pa.string()),
            ("benchmark", pa.string()),
            ("problem", pa.string()),
            ("ground_truth", pa.string()),
            ("data_source", pa.string()),
            *[(name, pa.string()) for name in subset_names],
            ("candidates", pa.list_(_CANDIDATE_TYPE)),
            ("permutations", pa.list_(pa.list_(pa.int32()))),
        ]
    )
    return pa.Table.from_pylist(rows, schema=schema)


def write_questions(path: str | os.PathLike, questions: Iterable[Question]) -> None:
    """Write ``questions`` to the parquet ``path`` atomically (temp file, then ``os.replace``).

    Every question passes the loader's checks first (a ``DataError`` names the item and field),
    all questions share one set of subset keys, and question ids are unique. Output bytes depend
    only on the questions (and the pyarrow version): same input, identical file.
    """
    path = Path(path)
    questions = list(questions)
    table = _table(questions, str(path.name))
    path.parent.mkdir(parents=True, exist_ok=True)
    # A per-process name in the same folder: os.replace is then atomic, and the file gets the
    # usual permissions (mkstemp's would be 0600).
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
