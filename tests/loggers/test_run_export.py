"""The run export's three files, read back with the csv/json modules (an independent reader)."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch
from lightning.pytorch.utilities import rank_zero_only

from atlas_lightning.loggers.run_export import RunExportLogger


def _read_csv(path):
    with open(path, newline="", encoding="utf-8") as handle:
        rows = list(csv.reader(handle))
    return rows[0], rows[1:]


def test_history_summary_config_hold_what_was_logged(tmp_path):
    config = {"name": "r", "algorithm": {"ppo_epochs": 2}}
    logger = RunExportLogger(tmp_path / "runs" / "r", "abc12345", config)
    # Validation before the first step (step 0), training steps, validation merged into step 2.
    logger.log_metrics({"gpqa/overall/acc": 0.25}, step=0)
    logger.log_metrics({"actor/pg_loss": -0.5, "critic/vf_loss": 1.5, "timing_s/gen": np.float32(3.0)}, step=1)
    logger.log_metrics({"actor/pg_loss": torch.tensor(0.125), "critic/vf_loss": 1.0}, step=2)
    logger.log_metrics({"gpqa/overall/acc": 0.5, 'odd,"name"': 7}, step=2)

    folder = tmp_path / "runs" / "r" / "abc12345"
    header, rows = _read_csv(folder / "history.csv")
    assert header == ["_step", "_runtime", "_timestamp", "gpqa/overall/acc", "actor/pg_loss",
                      "critic/vf_loss", "timing_s/gen", 'odd,"name"']
    assert [row[0] for row in rows] == ["0", "1", "2"]
    by_step = {int(row[0]): dict(zip(header, row)) for row in rows}
    assert float(by_step[0]["gpqa/overall/acc"]) == 0.25 and by_step[0]["actor/pg_loss"] == ""
    assert float(by_step[1]["actor/pg_loss"]) == -0.5 and by_step[1]["gpqa/overall/acc"] == ""
    assert float(by_step[1]["timing_s/gen"]) == 3.0
    assert float(by_step[2]["actor/pg_loss"]) == 0.125
    assert float(by_step[2]["gpqa/overall/acc"]) == 0.5 and float(by_step[2]['odd,"name"']) == 7.0
    for row in rows:
        assert float(row[1]) >= 0 and float(row[2]) > 1.7e9

    summary = json.loads((folder / "summary.json").read_text())
    assert summary == {"gpqa/overall/acc": 0.5, "actor/pg_loss": 0.125, "critic/vf_loss": 1.0,
                       "timing_s/gen": 3.0, 'odd,"name"': 7.0, "_step": 2}
    assert json.loads((folder / "config.json").read_text()) == config
    assert not list(folder.glob(".*.tmp")), "temporary files left behind"


def test_non_finite_values_are_spelled_out(tmp_path):
    logger = RunExportLogger(tmp_path, "id1", {})
    logger.log_metrics({"actor/entropy": float("nan"), "a": float("inf"), "b": -math.inf}, step=3)
    header, rows = _read_csv(tmp_path / "id1" / "history.csv")
    assert dict(zip(header, rows[0]))["actor/entropy"] == "nan"
    assert rows[0][header.index("a")] == "inf" and rows[0][header.index("b")] == "-inf"
    summary = json.loads((tmp_path / "id1" / "summary.json").read_text())
    assert summary["actor/entropy"] == "nan" and summary["a"] == "inf" and summary["b"] == "-inf"


def test_a_resumed_logger_continues_the_history(tmp_path):
    first = RunExportLogger(tmp_path, "same", {"k": 1})
    first.log_metrics({"x/y": 1.0}, step=1)
    first.log_metrics({"x/y": 2.0}, step=2)
    second = RunExportLogger(tmp_path, "same", {"k": 1})
    second.log_metrics({"x/y": 3.0, "new/metric": 9.0}, step=3)
    header, rows = _read_csv(tmp_path / "same" / "history.csv")
    assert [(row[0], row[header.index("x/y")]) for row in rows] == [("1", "1.0"), ("2", "2.0"), ("3", "3.0")]
    assert rows[0][header.index("new/metric")] == "" and rows[2][header.index("new/metric")] == "9.0"


def test_bad_input_is_refused_with_its_name(tmp_path):
    logger = RunExportLogger(tmp_path, "id2", {})
    with pytest.raises(ValueError, match="RL step"):
        logger.log_metrics({"a": 1.0}, step=None)
    with pytest.raises(ValueError, match="RL step"):
        logger.log_metrics({"a": 1.0}, step=-1)
    with pytest.raises(TypeError, match="'reward/acc'"):
        logger.log_metrics({"reward/acc": "high"}, step=1)
    with pytest.raises(ValueError, match="reserved"):
        logger.log_metrics({"_step": 1.0}, step=1)
    with pytest.raises(ValueError, match="run_id"):
        RunExportLogger(tmp_path, "../escape", {})
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "history.csv").write_text("step,a\n1,2\n")
    with pytest.raises(ValueError, match="history.csv.*_step"):
        RunExportLogger(tmp_path, "bad", {}).log_metrics({"a": 1.0}, step=2)


@pytest.mark.parametrize("damage, line", [
    (lambda text: text.replace("\n1,", "\nx1,", 1), 2),             # a step that is no number
    (lambda text: text.replace(",2.0", ",2.O", 1), 3),                 # a value that is no number
    (lambda text: text[: text.rindex(",")], 3),                        # a tail cut mid-row
])
def test_a_damaged_history_is_refused_by_line_and_left_as_it_was(tmp_path, damage, line):
    """A resumed logger must not rewrite a history it could not read whole: the rows it could not
    read would be gone. The error names the file and line; the file and summary stay as they were."""
    from atlas_lightning.errors import InputError

    first = RunExportLogger(tmp_path, "same", {})
    first.log_metrics({"x/y": 1.0, "z": 5.0}, step=1)
    first.log_metrics({"x/y": 2.0, "z": 6.0}, step=2)
    history, summary = tmp_path / "same" / "history.csv", tmp_path / "same" / "summary.json"
    history.write_text(damage(history.read_text()))
    before = (history.read_bytes(), summary.read_bytes())
    second = RunExportLogger(tmp_path, "same", {})
    with pytest.raises(InputError, match=rf"history.csv, line {line}: unreadable .*repair it or move it away"):
        second.log_metrics({"x/y": 3.0}, step=3)
    second.finalize("failed")
    assert (history.read_bytes(), summary.read_bytes()) == before


def test_only_rank_zero_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    logger = RunExportLogger(tmp_path, "id3", {"a": 1})
    logger.log_metrics({"a": 1.0}, step=1)
    logger.save()
    logger.finalize("success")
    assert not (tmp_path / "id3").exists()
