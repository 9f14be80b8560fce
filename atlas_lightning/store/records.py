"""Trajectory records (README, "On-disk layout"), the step's ``tensors.npz`` and ``manifest.json``.

On disk (README, "On-disk layout")::

    artifacts/<name>/{train,val}/step_N/
        <uid>_<session_id>.json   one TrajectoryRecord a trajectory (JSON, ``file_version`` 1)
        tensors.npz               the step's per-token arrays (prompt_ids, response_ids,
                                  response_mask, response_logprobs, response_versions, plus values, returns,
                                  advantages, ... given by the caller), ragged, see below
        manifest.json             every file of the folder with its size and sha256, counts

A record's JSON holds every field of ``RECORD_FIELDS``, then the per-token arrays
``TOKEN_ARRAY_FIELDS`` (``prompt_ids``, ``response_ids``, ``response_mask``,
``response_logprobs``: the seed report's four; ``response_versions``: the weights version that
generated each response token, -1 on tool-response tokens and where none is known) that the
record carries (every record the trainer writes carries all five; the
reading copy that ``publish`` sends without ``--weights`` strips them, ``strip_token_arrays``),
and may hold ``extra`` (a dict for additions that do not need a new version). Each array is one
JSON line of numbers (the rest of the record is indented, one field a line, so that it reads by
hand): token ids, mask and versions as integers, log-probs as the shortest decimal that reads back to the
same float32 (``null`` for a non-finite one; ``tensors.npz`` holds it exactly). When a record
carries the arrays their lengths must agree with the episode's ``token_counts``: ``prompt_ids``
with ``prompt``, ``response_ids`` with ``response``, the ones of ``response_mask`` with
``generated`` and its zeros with ``tool_response``. ``read_record`` refuses an unknown
``file_version``, a missing or unknown field and a field of the wrong type or length, naming
the file and the field (``RecordError``).

``tensors.npz`` keeps ragged per-trajectory arrays flat: for each array name ``X`` it holds ``X``
(all trajectories' arrays concatenated, in record order) and ``X__offsets`` (int64, length
n + 1: trajectory i is ``X[offsets[i]:offsets[i + 1]]``), plus ``uid`` and ``session_id``
(unicode arrays) naming the trajectories. Every file is written atomically (a temporary file in
the same folder, then ``os.replace``). Pure Python + numpy.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from atlas_lightning.errors import quoted
from atlas_lightning.store.atomic import atomic_write
from atlas_lightning.store.files import sha256_file

FILE_VERSION = 1
MANIFEST_NAME = "manifest.json"
TENSORS_NAME = "tensors.npz"
PARTITIONS = ("train", "val")

#: Every top-level field of a record's JSON, in the order written.
RECORD_FIELDS = (
    "file_version", "run_id", "partition", "global_steps", "uid", "session_id", "attempt_id",
    "data_source", "benchmark", "question_id", "permutation_id", "candidate_fingerprint",
    "ground_truth", "reward_score", "num_turns", "written_at", "episode", "reward", "reward_trace",
)
#: Per-token arrays: on the record object, in its JSON (after ``reward_trace``)
#: and in the step's tensors.npz; stripped from the reading copy.
TOKEN_ARRAY_FIELDS = ("prompt_ids", "response_ids", "response_mask", "response_logprobs", "response_versions")
OPTIONAL_FIELDS = ("extra",) + TOKEN_ARRAY_FIELDS
#: The dtype each per-token array has on a record object.
TOKEN_ARRAY_DTYPES = {"prompt_ids": np.int64, "response_ids": np.int64, "response_mask": np.int8,
                      "response_logprobs": np.float32, "response_versions": np.int64}

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_STR_FIELDS = ("run_id", "data_source", "benchmark", "question_id", "candidate_fingerprint", "ground_truth", "written_at")
_INT_FIELDS = {"global_steps": 0, "attempt_id": 0, "num_turns": 0, "file_version": 1, "permutation_id": None}
_DICT_FIELDS = ("episode", "reward", "reward_trace", "extra")


class RecordError(ValueError):
    """A record, tensors file or manifest that cannot be written or read; names file and field."""


def utc_now() -> str:
    """``2026-09-12T07:47:00Z``: the format of ``written_at``."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def record_filename(uid: str, session_id: str) -> str:
    """``<uid>_<session_id>.json``; both parts must be safe file-name components."""
    for name, value in (("uid", uid), ("session_id", session_id)):
        if not isinstance(value, str) or not _SAFE_NAME.match(value):
            raise RecordError(f"{name}={value!r} must match {_SAFE_NAME.pattern} (it is part of a file name)")
    return f"{uid}_{session_id}.json"


def step_folder(artifacts: str | os.PathLike, partition: str, global_step: int) -> Path:
    """``artifacts/<name>/{train,val}/step_N`` given ``artifacts/<name>``."""
    if partition not in PARTITIONS:
        raise RecordError(f"partition={partition!r} must be one of {', '.join(PARTITIONS)}")
    return Path(artifacts) / partition / f"step_{int(global_step)}"


@dataclass
class TrajectoryRecord:
    """One trajectory: the record fields of the README's "On-disk layout" plus its per-token arrays (kept out of JSON).

    ``reward_score`` is ``reward["training_reward"]``; ``reward_trace`` offsets index the response
    arrays. ``written_at`` empty means "stamp it when written".
    """

    run_id: str
    partition: str
    global_steps: int
    uid: str
    session_id: str
    attempt_id: int
    data_source: str
    benchmark: str
    question_id: str
    permutation_id: int
    candidate_fingerprint: str
    ground_truth: str
    reward_score: float
    num_turns: int
    episode: dict
    reward: dict
    reward_trace: dict
    written_at: str = ""
    file_version: int = FILE_VERSION
    extra: dict = field(default_factory=dict)
    prompt_ids: np.ndarray | None = None
    response_ids: np.ndarray | None = None
    response_mask: np.ndarray | None = None
    response_logprobs: np.ndarray | None = None
    response_versions: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def filename(self) -> str:
        return record_filename(self.uid, self.session_id)

    def validate(self, where: str = "record") -> None:
        """``RecordError`` naming the first field that is missing its contract."""
        try:
            record_filename(self.uid, self.session_id)
        except RecordError as err:
            raise RecordError(f"{where}: {err}") from None
        if self.file_version != FILE_VERSION:
            raise RecordError(f"{where}: file_version {self.file_version!r} is not {FILE_VERSION}")
        if self.partition not in PARTITIONS:
            raise RecordError(f"{where}: partition={self.partition!r} must be one of {', '.join(PARTITIONS)}")
        for name in _STR_FIELDS:
            if not isinstance(getattr(self, name), str):
                raise RecordError(f"{where}: field {name} must be a string, got {type(getattr(self, name)).__name__}")
        for name, low in _INT_FIELDS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or (low is not None and value < low):
                bound = f" >= {low}" if low is not None else ""
                raise RecordError(f"{where}: field {name} must be an int{bound}, got {value!r}")
        for name in _DICT_FIELDS:
            if not isinstance(getattr(self, name), dict):
                raise RecordError(f"{where}: field {name} must be an object, got {type(getattr(self, name)).__name__}")
        score = self.reward_score
        if not isinstance(score, (int, float)) or isinstance(score, bool) or not math.isfinite(score):
            raise RecordError(f"{where}: field reward_score must be a finite number, got {score!r}")
        if "training_reward" in self.reward and self.reward["training_reward"] != score:
            raise RecordError(
                f"{where}: reward_score={score!r} differs from reward.training_reward={self.reward['training_reward']!r}"
            )
        offsets, values = self.reward_trace.get("offsets"), self.reward_trace.get("values")
        if not isinstance(offsets, list) or not isinstance(values, list) or len(offsets) != len(values):
            raise RecordError(f"{where}: field reward_trace needs lists 'offsets' and 'values' of equal length")
        self._validate_arrays(where, offsets)

    def _validate_arrays(self, where: str, offsets: list) -> None:
        lengths = {}
        for name in TOKEN_ARRAY_FIELDS:
            array = getattr(self, name)
            if array is None:
                continue
            array = np.asarray(array)
            if array.ndim != 1:
                raise RecordError(f"{where}: {name} must be 1-D, got shape {array.shape}")
            setattr(self, name, array)
            if name != "prompt_ids":
                lengths[name] = len(array)
        if len(set(lengths.values())) > 1:
            raise RecordError(f"{where}: response arrays differ in length: {lengths}")
        if lengths:
            length = next(iter(lengths.values()))
            if any(not 0 <= o < length for o in offsets):
                raise RecordError(f"{where}: reward_trace offsets {offsets} fall outside the response (length {length})")
        if self.response_mask is not None and not np.isin(self.response_mask, (0, 1)).all():
            raise RecordError(f"{where}: response_mask must hold only 0 and 1")
        if self.response_versions is not None and (self.response_versions < -1).any():
            raise RecordError(f"{where}: response_versions must hold versions >= 0, or -1 (none)")
        self._validate_token_counts(where)

    def _validate_token_counts(self, where: str) -> None:
        """The arrays against the episode's ``token_counts`` (module doc), where both exist."""
        counts = self.episode.get("token_counts") if isinstance(self.episode, dict) else None
        if not isinstance(counts, dict):
            return
        checks = []
        if self.prompt_ids is not None:
            checks.append(("len(prompt_ids)", len(self.prompt_ids), "prompt"))
        if self.response_ids is not None:
            checks.append(("len(response_ids)", len(self.response_ids), "response"))
        if self.response_mask is not None:
            ones = int(np.count_nonzero(self.response_mask))
            checks += [("ones of response_mask", ones, "generated"),
                       ("zeros of response_mask", len(self.response_mask) - ones, "tool_response")]
        for what, value, key in checks:
            expected = counts.get(key)
            if expected is not None and value != expected:
                raise RecordError(f"{where}: {what} is {value}, the episode's token_counts.{key} is {expected}")

    def to_json_dict(self) -> dict:
        """The JSON content: ``RECORD_FIELDS`` in order, the per-token arrays that are set (as
        lists: ``token_array_json``), then ``extra`` if non-empty."""
        data = {name: getattr(self, name) for name in RECORD_FIELDS}
        for name, array in self.token_arrays().items():
            data[name] = token_array_json(name, array)
        if self.extra:
            data["extra"] = self.extra
        return data

    def token_arrays(self) -> dict[str, np.ndarray]:
        """The per-token arrays that are set, by name."""
        return {name: getattr(self, name) for name in TOKEN_ARRAY_FIELDS if getattr(self, name) is not None}

    @classmethod
    def from_json_dict(cls, data: Mapping[str, Any], where: str = "record") -> "TrajectoryRecord":
        """Refuses an unknown version, missing or unknown fields and wrong types (``RecordError``)."""
        if not isinstance(data, Mapping):
            raise RecordError(f"{where}: the JSON is a {type(data).__name__}, not an object")
        if "file_version" not in data:
            raise RecordError(f"{where}: missing field file_version")
        if data["file_version"] != FILE_VERSION or isinstance(data["file_version"], bool):
            raise RecordError(
                f"{where}: file_version {data['file_version']!r} is not supported (this reader reads {FILE_VERSION})"
            )
        missing = [name for name in RECORD_FIELDS if name not in data]
        if missing:
            raise RecordError(f"{where}: missing field(s) {', '.join(missing)}")
        unknown = sorted(set(data) - set(RECORD_FIELDS) - set(OPTIONAL_FIELDS))
        if unknown:
            raise RecordError(f"{where}: unknown field(s) {', '.join(unknown)} for file_version {FILE_VERSION}")
        # Bypass __init__ so that the checks below name the file, not a constructor call.
        record = cls.__new__(cls)
        for f in fields(cls):
            setattr(record, f.name, data.get(f.name))
        if record.extra is None:
            record.extra = {}
        for name in TOKEN_ARRAY_FIELDS:
            if name in data:
                setattr(record, name, _token_array_from_json(name, data[name], where))
        record.validate(where)
        return record


def token_array_json(name: str, array: np.ndarray) -> list:
    """A per-token array as the JSON list written in a record: integers for ids and mask; for
    log-probs the shortest decimal that reads back to the same float32, None if not finite."""
    array = np.asarray(array)
    if name != "response_logprobs":
        return array.astype(np.int64).tolist()
    values = array.astype(np.float32)
    # numpy's str of a float32 is its shortest round-tripping decimal; float() keeps that digit
    # string as the JSON number (float64's repr of it is the same digits)
    return [float(text) if finite else None for text, finite in zip(values.astype(str), np.isfinite(values))]


def _token_array_from_json(name: str, value: Any, where: str) -> np.ndarray:
    """The record object's array from its JSON list; ``RecordError`` naming the field."""
    if not isinstance(value, list):
        raise RecordError(f"{where}: field {name} must be a list of numbers, got {type(value).__name__}")
    if name == "response_logprobs":
        bad = next((v for v in value if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)))), None)
        if bad is not None:
            raise RecordError(f"{where}: field {name} holds {bad!r}, not a number")
        return np.asarray([np.nan if v is None else v for v in value], dtype=np.float32)
    bad = next((v for v in value if isinstance(v, bool) or not isinstance(v, int)), None)
    if bad is not None:
        raise RecordError(f"{where}: field {name} holds {bad!r}, not an integer")
    return np.asarray(value, dtype=TOKEN_ARRAY_DTYPES[name])


def build_record(
    episode: Mapping[str, Any],
    scored: Mapping[str, Any],
    *,
    run_id: str,
    partition: str,
    global_steps: int,
    uid: str,
    session_id: str,
    ground_truth: str,
    data_source: str = "",
    attempt_id: int = 0,
    extra: dict | None = None,
    **token_arrays: np.ndarray | None,
) -> TrajectoryRecord:
    """A record from an ended episode (``Episode.to_record_episode()``) and its score
    (``reward.score_episode``: ``reward``, ``reward_trace``). ``token_arrays``: any of
    ``TOKEN_ARRAY_FIELDS``."""
    unknown = sorted(set(token_arrays) - set(TOKEN_ARRAY_FIELDS))
    if unknown:
        raise RecordError(f"build_record: unknown per-token array(s) {', '.join(unknown)}")
    reward = dict(scored["reward"])
    return TrajectoryRecord(
        run_id=run_id, partition=partition, global_steps=global_steps, uid=uid, session_id=session_id,
        attempt_id=attempt_id, data_source=data_source, benchmark=episode["benchmark"],
        question_id=episode["question_id"], permutation_id=episode["permutation_id"],
        candidate_fingerprint=episode["candidate_fingerprint"], ground_truth=ground_truth,
        reward_score=reward["training_reward"], num_turns=episode["num_turns"], episode=dict(episode),
        reward=reward, reward_trace=dict(scored["reward_trace"]), extra=dict(extra or {}), **token_arrays,
    )


# ----------------------------------------------------------------------------- files





def record_json_text(data: Mapping[str, Any], where: str = "record") -> str:
    """A record's JSON text (module doc): one field a line, indented, each per-token array on a
    single line. ASCII-escaped (a lone surrogate in model text cannot break the write); refuses
    NaN/Infinity (``RecordError``)."""
    arrays = [(name, data[name]) for name in TOKEN_ARRAY_FIELDS if name in data]
    rest = {key: value for key, value in data.items() if key not in TOKEN_ARRAY_FIELDS}
    try:
        text = json.dumps(rest, ensure_ascii=True, allow_nan=False, indent=1)
        lines = [f" {json.dumps(name)}: {json.dumps(list(value), allow_nan=False, separators=(',', ':'))}"
                 for name, value in arrays]
    except (TypeError, ValueError) as err:
        raise RecordError(f"{where}: cannot be written as JSON ({err})") from None
    if lines:
        # the arrays go last, after the fields a reader looks at first
        text = text[:-2] + ",\n" + ",\n".join(lines) + "\n}" if rest else "{\n" + ",\n".join(lines) + "\n}"
    return text + "\n"


def strip_token_arrays(text: str, where: str = "record") -> str:
    """The reading copy of a record's JSON text: the same record without its per-token arrays
    (what ``publish`` without ``--weights`` sends). ``RecordError`` if it is not
    a JSON object."""
    try:
        data = json.loads(text)
    except ValueError as err:
        raise RecordError(f"{where}: cannot be read ({quoted(str(err))})") from None
    if not isinstance(data, dict):
        raise RecordError(f"{where}: the JSON is a {type(data).__name__}, not an object")
    return record_json_text({k: v for k, v in data.items() if k not in TOKEN_ARRAY_FIELDS}, where)


def write_record(folder: str | os.PathLike, record: TrajectoryRecord) -> Path:
    """Write ``folder/<uid>_<session_id>.json`` atomically (``record_json_text``); stamps
    ``written_at`` if empty."""
    record.validate()
    data = record.to_json_dict()
    if not data["written_at"]:
        data["written_at"] = utc_now()
    path = Path(folder) / record.filename
    text = record_json_text(data, where=f"record {path}")
    return atomic_write(path, lambda handle: handle.write(text))


def read_record(path: str | os.PathLike) -> TrajectoryRecord:
    """Read a record file (with its per-token arrays when it carries them)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RecordError(f"record {path}: cannot be read ({quoted(str(err))})") from None
    record = TrajectoryRecord.from_json_dict(data, where=f"record {path}")
    if path.name != record.filename:
        raise RecordError(f"record {path}: its uid and session_id name it {record.filename}")
    return record


def write_step_tensors(
    folder: str | os.PathLike,
    records: Sequence[TrajectoryRecord],
    extra: Mapping[str, Sequence[np.ndarray]] | None = None,
) -> Path:
    """Write ``folder/tensors.npz``: the records' per-token arrays (those set on every record) and
    ``extra`` arrays (name -> one 1-D array per record, e.g. ``values``, ``advantages``)."""
    path = Path(folder) / TENSORS_NAME
    columns: dict[str, list[np.ndarray]] = {}
    for name in TOKEN_ARRAY_FIELDS:
        present = [getattr(r, name) is not None for r in records]
        if any(present) and not all(present):
            raise RecordError(f"{path}: {name} is set on some records and not on others")
        if records and all(present):
            columns[name] = [np.asarray(getattr(r, name)) for r in records]
    for name, arrays in (extra or {}).items():
        if name in columns or name in ("uid", "session_id") or name.endswith("__offsets"):
            raise RecordError(f"{path}: extra array name {name!r} is reserved")
        if len(arrays) != len(records):
            raise RecordError(f"{path}: extra array {name!r} has {len(arrays)} entries for {len(records)} records")
        columns[name] = [np.asarray(a) for a in arrays]
    payload: dict[str, np.ndarray] = {
        "uid": np.array([r.uid for r in records], dtype=str),
        "session_id": np.array([r.session_id for r in records], dtype=str),
    }
    for name, arrays in columns.items():
        for i, array in enumerate(arrays):
            if array.ndim != 1:
                raise RecordError(f"{path}: {name} of record {i} must be 1-D, got shape {array.shape}")
        payload[name] = np.concatenate(arrays) if arrays else np.zeros(0)
        payload[f"{name}__offsets"] = np.cumsum([0] + [len(a) for a in arrays], dtype=np.int64)
    return atomic_write(path, lambda handle: np.savez(handle, **payload), binary=True)


def read_step_tensors(path: str | os.PathLike) -> dict[str, list]:
    """``{"uid": [str], "session_id": [str], name: [1-D array per record], ...}``."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
    except (OSError, ValueError) as err:
        raise RecordError(f"{path}: cannot be read ({quoted(str(err))})") from None
    result: dict[str, list] = {"uid": arrays.pop("uid").tolist(), "session_id": arrays.pop("session_id").tolist()}
    for key in sorted(k for k in arrays if not k.endswith("__offsets")):
        offsets = arrays.get(f"{key}__offsets")
        if offsets is None or len(offsets) != len(result["uid"]) + 1 or offsets[-1] != len(arrays[key]):
            raise RecordError(f"{path}: {key}__offsets is missing or does not match {key}")
        result[key] = [arrays[key][offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
    return result


# ----------------------------------------------------------------------------- manifest


def _listed_files(folder: Path) -> Iterable[Path]:
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if path.is_file() and not any(part.startswith(".") for part in relative.parts) and relative.as_posix() != MANIFEST_NAME:
            yield path


def write_manifest(folder: str | os.PathLike, extra: Mapping[str, Any] | None = None) -> Path:
    """Write ``folder/manifest.json``: ``{"file_version", "written_at", "counts": {"files",
    "records", "bytes"}, "files": [{"path", "bytes", "sha256"}], **extra}`` over every file of
    the folder (sorted; hidden temporary files and the manifest itself left out)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise RecordError(f"write_manifest: {folder} is not a folder")
    entries = [
        {"path": p.relative_to(folder).as_posix(), "bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in _listed_files(folder)
    ]
    records = sum(1 for e in entries if e["path"].endswith(".json") and "/" not in e["path"])
    manifest = {
        "file_version": FILE_VERSION,
        "written_at": utc_now(),
        "counts": {"files": len(entries), "records": records, "bytes": sum(e["bytes"] for e in entries)},
        "files": entries,
    }
    for key, value in (extra or {}).items():
        if key in manifest:
            raise RecordError(f"write_manifest: extra key {key!r} would overwrite a manifest field")
        manifest[key] = value
    text = json.dumps(manifest, indent=1, ensure_ascii=True, allow_nan=False)
    return atomic_write(folder / MANIFEST_NAME, lambda handle: handle.write(text + "\n"))


def verify_manifest(folder: str | os.PathLike) -> list[str]:
    """Problems found comparing ``folder`` with its manifest (empty list: it matches)."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
        listed = {e["path"]: e for e in manifest["files"]}
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [f"{folder / MANIFEST_NAME}: cannot be read ({quoted(str(err))})"]
    present = {p.relative_to(folder).as_posix(): p for p in _listed_files(folder)}
    problems = [f"{name}: listed but missing" for name in sorted(set(listed) - set(present))]
    problems += [f"{name}: present but not listed" for name in sorted(set(present) - set(listed))]
    for name in sorted(set(listed) & set(present)):
        if present[name].stat().st_size != listed[name].get("bytes") or sha256_file(present[name]) != listed[name].get("sha256"):
            problems.append(f"{name}: size or sha256 differs from the manifest")
    return problems
