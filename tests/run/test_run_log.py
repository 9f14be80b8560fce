"""The run's logs on a disk that refuses writes: one line on stderr, the lines counted, never
logging's "--- Logging error ---" traceback; a disk full before the first step (the config
cannot be written) is the write stop too. A real fit whose log and checkpoint meet a full disk
ends in the write stop's one line (exit 7) and nothing else: ``tests/e2e/test_colocated_merged.py``
(the launch that also checks the merged syncs)."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest

from atlas_lightning.cli import main
from atlas_lightning.run.wiring import RunLogHandler

FULL = Path("/dev/full")  # every write: ENOSPC
needs_full = pytest.mark.skipif(not FULL.exists(), reason="needs /dev/full")


@needs_full
def test_a_log_line_the_disk_refuses_is_counted_and_said_once_without_a_traceback(capsys):
    handler = RunLogHandler(FULL)
    logger = logging.getLogger("atlas_lightning.test_run_log")
    logger.addHandler(handler)
    try:
        for index in range(3):
            logger.error("stopped: line %d", index)
    finally:
        logger.removeHandler(handler)
        handler.close()
    err = capsys.readouterr().err
    assert "Logging error" not in err and "Traceback" not in err
    assert err.count("\n") == 1 and f"the run's log {FULL} cannot be written (No space left on device)" in err
    assert handler.lost >= 3 and handler.failure.errno == errno.ENOSPC  # three lines, and the close's flush


def test_a_log_call_that_is_a_bug_is_still_reported_as_logging_reports_it(tmp_path, capsys):
    handler = RunLogHandler(tmp_path / "main_ppo.log")
    logger = logging.getLogger("atlas_lightning.test_run_log_bug")
    logger.addHandler(handler)
    logger.propagate = False  # pytest's capturing handler raises on it
    try:
        logger.error("%d steps", "not a number")
    finally:
        logger.removeHandler(handler)
        handler.close()
    assert "--- Logging error ---" in capsys.readouterr().err and handler.lost == 0


def test_a_config_the_disk_cannot_hold_is_the_write_stop(tmp_path, sample_data_dir, tiny_model_dir, capsys,
                                                          monkeypatch):
    """The disk full before the first step: ``config.yaml`` cannot be written: exit 7, one line."""
    import atlas_lightning.run.wiring as wiring

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(wiring, "atomic_write_text", full)
    code = main(["fit", "experiment=tiny-cpu", f"paths.root={tmp_path}", f"model.path={tiny_model_dir}",
                 f"data.root={sample_data_dir}", "logger.mode=disabled"])
    err = capsys.readouterr().err
    assert code == 7, err
    assert "Traceback" not in err
    assert "a file of the run could not be written after RL step 0" in err and "No space left on device" in err
    assert "free space on the file system" in err
