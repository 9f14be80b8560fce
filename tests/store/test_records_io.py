"""Trajectory records, tensors.npz and manifest.json: round trips and refusals."""

import dataclasses
import hashlib
import json
import os

import numpy as np
import pytest

from atlas_lightning.env import Episode
from atlas_lightning.store.records import (
    FILE_VERSION,
    RECORD_FIELDS,
    RecordError,
    build_record,
    read_record,
    read_step_tensors,
    record_filename,
    step_folder,
    verify_manifest,
    write_manifest,
    write_record,
    write_step_tensors,
)
from atlas_lightning.reward import score_episode

SEED_SECTION_4 = ["file_version", "run_id", "partition", "global_steps", "uid", "session_id", "attempt_id",
                  "data_source", "benchmark", "question_id", "permutation_id", "candidate_fingerprint",
                  "ground_truth", "reward_score", "num_turns", "written_at", "episode", "reward", "reward_trace"]


def make_record(build, uid="u1", session_id="s0", with_arrays=True, answer="B"):
    question = build.question()
    episode = Episode(question, 0)
    episode.on_prompt_tokens(6)
    # Turns of 5 tokens and responses of 7: response length 17 after explore + submit.
    build.run(episode, [build.call("explore") + "\udcff", build.call("submit", {"answer": answer})])
    record_episode = episode.to_record_episode()
    scored = score_episode(record_episode, 0.1)
    arrays = {}
    if with_arrays:
        mask = np.array([1] * 5 + [0] * 7 + [1] * 5, dtype=np.int8)
        arrays = dict(prompt_ids=np.arange(6, dtype=np.int64), response_ids=np.arange(100, 117, dtype=np.int64),
                      response_mask=mask, response_logprobs=np.where(mask == 1, -0.5, 0.0).astype(np.float32))
    return build_record(record_episode, scored, run_id="run-1", partition="train", global_steps=3, uid=uid,
                        session_id=session_id, ground_truth=question.ground_truth, data_source="gpqa_diamond",
                        **arrays)


def test_fields_are_the_seeds(build):
    assert list(RECORD_FIELDS) == SEED_SECTION_4
    record = make_record(build)
    data = record.to_json_dict()
    assert list(data) == SEED_SECTION_4 + ["prompt_ids", "response_ids", "response_mask", "response_logprobs"]
    assert data["response_ids"] == list(range(100, 117)) and data["response_logprobs"][:6] == [-0.5] * 5 + [0.0]
    assert list(make_record(build, with_arrays=False).to_json_dict()) == SEED_SECTION_4
    assert data["reward_score"] == data["reward"]["training_reward"] == pytest.approx(1 - 0.012, abs=1e-15)
    assert data["episode"]["events"][0]["explore_k"] == 1 and data["num_turns"] == 2
    assert data["candidate_fingerprint"] == data["episode"]["candidate_fingerprint"]


def test_write_then_read_round_trip(build, tmp_path):
    record = make_record(build)
    path = write_record(tmp_path, record)
    assert path.name == "u1_s0.json" == record_filename("u1", "s0")
    assert [p.name for p in tmp_path.iterdir()] == ["u1_s0.json"]  # no temporary file left
    back = read_record(path)
    assert back.to_json_dict() == {**record.to_json_dict(), "written_at": back.written_at}
    assert back.written_at.endswith("Z") and back.file_version == FILE_VERSION
    assert back.episode["generations"][0]["text"].endswith("\udcff")  # lone surrogate survives
    for name, array in record.token_arrays().items():  # the four arrays ride in the JSON
        np.testing.assert_array_equal(getattr(back, name), array)
        assert getattr(back, name).dtype == array.dtype
    bare = read_record(write_record(tmp_path / "bare", make_record(build, with_arrays=False)))
    assert bare.response_ids is None and bare.token_arrays() == {}


def test_arrays_are_one_line_each_and_log_probs_round_trip_as_float32(build, tmp_path):
    record = make_record(build)
    record.response_logprobs = np.where(record.response_mask == 1, np.float32(-0.123456789), 0).astype(np.float32)
    record.response_logprobs[1] = -np.inf
    text = write_record(tmp_path, record).read_text()
    lines = text.splitlines()
    assert ' "response_mask": [1,1,1,1,1,0,0,0,0,0,0,0,1,1,1,1,1],' in lines
    assert any(line.startswith(' "response_logprobs": [-0.12345679,null,-0.12345679,') for line in lines)
    assert lines[1] == ' "file_version": 1,' and lines[-1] == "}"
    back = read_record(tmp_path / record.filename)
    expected = record.response_logprobs.copy()
    expected[1] = np.nan  # a non-finite log-prob is null in JSON (tensors.npz keeps it exactly)
    np.testing.assert_array_equal(back.response_logprobs, expected)


def test_strip_token_arrays_gives_the_reading_copy(build, tmp_path):
    from atlas_lightning.store.records import strip_token_arrays

    path = write_record(tmp_path, make_record(build))
    stripped = strip_token_arrays(path.read_text())
    data = json.loads(stripped)
    assert list(data) == SEED_SECTION_4
    assert data == {k: v for k, v in json.loads(path.read_text()).items() if k in SEED_SECTION_4}
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / path.name).write_text(stripped)
    assert read_record(tmp_path / "copy" / path.name).token_arrays() == {}
    with pytest.raises(RecordError, match="not an object"):
        strip_token_arrays("[1, 2]")


def _rewrite(path, mutate):
    data = json.loads(path.read_text())
    mutate(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(file_version=2), "file_version 2 is not supported"),
    (lambda d: d.pop("file_version"), "missing field file_version"),
    (lambda d: (d.pop("reward"), d.pop("uid")), "missing field.*uid.*reward"),
    (lambda d: d.update(surprise=1), "unknown field.*surprise"),
    (lambda d: d.update(global_steps="3"), "global_steps must be an int"),
    (lambda d: d.update(partition="test"), "partition"),
    (lambda d: d.update(reward_score=0.5), "differs from reward.training_reward"),
    (lambda d: d.update(episode=[]), "episode must be an object"),
    (lambda d: d["reward_trace"].update(values=[1.0]), "reward_trace needs lists"),
    (lambda d: d.update(uid="../evil"), "uid"),
    (lambda d: d.update(response_ids=d["response_ids"][:-1]), "response arrays differ"),
    (lambda d: d.update(prompt_ids=d["prompt_ids"][:-1]), r"len\(prompt_ids\) is 5, the episode's token_counts.prompt is 6"),
    (lambda d: d["episode"]["token_counts"].update(generated=9), "ones of response_mask is 10.*generated is 9"),
    (lambda d: d.update(response_ids=[1.5] * 17), "response_ids holds 1.5, not an integer"),
    (lambda d: d.update(response_logprobs="x"), "response_logprobs must be a list"),
])
def test_reader_refuses_clearly(build, tmp_path, mutate, message):
    path = write_record(tmp_path, make_record(build))
    _rewrite(path, mutate)
    with pytest.raises(RecordError, match=message) as err:
        read_record(path)
    assert str(path) in str(err.value)


def test_reader_refuses_a_renamed_record(build, tmp_path):
    path = write_record(tmp_path, make_record(build))
    renamed = path.rename(tmp_path / "u1_s9.json")
    with pytest.raises(RecordError, match="name it u1_s0.json"):
        read_record(renamed)


def test_reader_refuses_non_json(tmp_path):
    path = tmp_path / "u_s.json"
    path.write_text("{not json")
    with pytest.raises(RecordError, match="cannot be read"):
        read_record(path)


def test_writer_refuses_bad_records(build, tmp_path):
    record = make_record(build)
    record.reward["cost"] = float("nan")
    with pytest.raises(RecordError, match="cannot be written as JSON"):
        write_record(tmp_path, record)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RecordError, match="session_id"):
        record_filename("u1", "a/b")
    good = make_record(build)
    with pytest.raises(RecordError, match="response arrays differ"):
        dataclasses.replace(good, response_mask=np.ones(3, dtype=np.int8))
    with pytest.raises(RecordError, match="outside the response"):
        dataclasses.replace(good, response_ids=np.arange(5), response_mask=None, response_logprobs=None)
    with pytest.raises(RecordError, match="only 0 and 1"):
        dataclasses.replace(good, response_mask=np.full(17, 2, dtype=np.int8))
    with pytest.raises(RecordError, match="must be 1-D"):
        dataclasses.replace(good, prompt_ids=np.zeros((2, 3)))
    with pytest.raises(RecordError, match="unknown per-token"):
        build_record(good.episode, {"reward": good.reward, "reward_trace": good.reward_trace}, run_id="r",
                     partition="val", global_steps=0, uid="u", session_id="s", ground_truth="B", values=np.zeros(3))


def test_a_failed_write_keeps_the_old_file(build, tmp_path):
    path = write_record(tmp_path, make_record(build))
    before = path.read_bytes()
    record = make_record(build)
    record.extra = {"bad": object()}
    with pytest.raises(RecordError):
        write_record(tmp_path, record)
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["u1_s0.json"]


def test_step_tensors_round_trip(build, tmp_path):
    records = [make_record(build, session_id="s0"), make_record(build, session_id="s1")]
    values = [np.linspace(0, 1, 17, dtype=np.float32), np.zeros(17, dtype=np.float32)]
    path = write_step_tensors(tmp_path, records, extra={"values": values})
    back = read_step_tensors(path)
    assert back["uid"] == ["u1", "u1"] and back["session_id"] == ["s0", "s1"]
    for i, record in enumerate(records):
        for name, array in record.token_arrays().items():
            np.testing.assert_array_equal(back[name][i], array)
        np.testing.assert_array_equal(back["values"][i], values[i])
    with pytest.raises(RecordError, match="some records and not on others"):
        write_step_tensors(tmp_path, [records[0], make_record(build, with_arrays=False)])
    with pytest.raises(RecordError, match="1 entries for 2 records"):
        write_step_tensors(tmp_path, records, extra={"values": values[:1]})


def test_manifest_lists_and_verifies(build, tmp_path):
    folder = step_folder(tmp_path / "artifacts" / "run", "train", 3)
    assert folder.as_posix().endswith("artifacts/run/train/step_3")
    records = [make_record(build, session_id=f"s{i}") for i in range(3)]
    for record in records:
        write_record(folder, record)
    write_step_tensors(folder, records)
    manifest_path = write_manifest(folder, extra={"global_step": 3, "partition": "train"})
    manifest = json.loads(manifest_path.read_text())
    assert manifest["counts"]["records"] == 3 and manifest["counts"]["files"] == 4
    assert [f["path"] for f in manifest["files"]] == ["tensors.npz", "u1_s0.json", "u1_s1.json", "u1_s2.json"]
    first = folder / "u1_s0.json"
    assert manifest["files"][1]["sha256"] == hashlib.sha256(first.read_bytes()).hexdigest()
    assert manifest["global_step"] == 3
    assert verify_manifest(folder) == []
    first.write_text(first.read_text().replace('"run-1"', '"run-2"'))
    (folder / "u1_s1.json").unlink()
    (folder / "late.json").write_text("{}")
    assert verify_manifest(folder) == ["u1_s1.json: listed but missing", "late.json: present but not listed",
                                       "u1_s0.json: size or sha256 differs from the manifest"]
    with pytest.raises(RecordError, match="overwrite"):
        write_manifest(folder, extra={"files": []})


def test_response_versions_ride_after_the_seeds_arrays_and_are_checked(build, tmp_path):
    """The per-token weights version: an added array after the seed's four, never renaming one."""
    record = make_record(build)
    versions = np.where(record.response_mask == 1, 3, -1).astype(np.int64)
    versions[-2:] = 4  # a turn that straddles a weight change
    record.response_versions = versions
    path = write_record(tmp_path, record)
    data = json.loads(path.read_text())
    assert list(data)[: len(SEED_SECTION_4)] == SEED_SECTION_4
    assert list(data)[len(SEED_SECTION_4):] == ["prompt_ids", "response_ids", "response_mask", "response_logprobs",
                                                "response_versions"]
    back = read_record(path)
    np.testing.assert_array_equal(back.response_versions, versions)
    assert back.response_versions.dtype == np.int64
    tensors = read_step_tensors(write_step_tensors(tmp_path, [record]))
    np.testing.assert_array_equal(tensors["response_versions"][0], versions)
    with pytest.raises(RecordError, match="response_versions must hold versions >= 0, or -1"):
        dataclasses.replace(record, response_versions=versions - 5)
    with pytest.raises(RecordError, match="response arrays differ in length"):
        dataclasses.replace(record, response_versions=versions[:-1])
