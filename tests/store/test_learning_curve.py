"""The closing summary's learning line: the paired test of the last validation against the first,
checked against a computation by hand (``store/learning_curve.py``)."""

from __future__ import annotations

import json
import math

from atlas_lightning.store.learning_curve import learning_line, read_step, summarize, val_steps


def _step(artifacts, step, objectives: dict[str, list[float]]):
    folder = artifacts / "val" / f"step_{step}"
    folder.mkdir(parents=True)
    for qid, values in objectives.items():
        for k, value in enumerate(values):
            reward = {"objective": value, "acc": float(value > 0), "cost_total": 0.1, "num_explores": 1}
            (folder / f"{qid}_{k}.json").write_text(json.dumps({"question_id": qid, "reward": reward}))
    (folder / "manifest.json").write_text("{}")


def test_the_gain_is_paired_by_question_with_its_standard_error(tmp_path):
    _step(tmp_path, 0, {"a": [0.0, 0.2], "b": [0.5, 0.5], "c": [-0.1, -0.1]})
    _step(tmp_path, 3, {"a": [0.4, 0.6], "b": [0.5, 0.9], "c": [0.3, 0.1]})
    (tmp_path / "val" / "step_5").mkdir()  # no manifest: unfinished, not read
    assert list(val_steps(tmp_path)) == [0, 3]
    result = summarize({s: read_step(f) for s, f in val_steps(tmp_path).items()})
    diffs = [0.5 - 0.1, 0.7 - 0.5, 0.2 - (-0.1)]
    mean = sum(diffs) / 3
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2) / math.sqrt(3)
    assert math.isclose(result["objective_gain"], mean) and math.isclose(result["gain_se"], se)
    line = learning_line(tmp_path)
    assert line.startswith("validation objective +0.167 at step 0 -> +0.467 at step 3: gain +0.300 +- 0.058")
    assert "paired SE over 3 questions, z 5.2): learned" in line


def test_one_validation_gives_no_line(tmp_path):
    _step(tmp_path, 0, {"a": [0.0]})
    assert learning_line(tmp_path) is None and learning_line(tmp_path / "absent") is None
