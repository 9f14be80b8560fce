"""A write the storage refuses part-way through a fit is a clean stop (``run/faults.py``, exit 7):
a checkpoint that could not be written (``CheckpointWriteError``) and any ``OSError`` of a full
disk, a quota, a read-only file system, an I/O error or a permission taken away, naming the cause
and what to free or grant; an
``OSError`` of another kind (a missing file) is no such stop and passes on. The stop inside a
fit (the disk full as a checkpoint is written, the previous checkpoint intact and resumed) is in
``tests/e2e/test_faults.py``."""

from __future__ import annotations

import errno
import os

import pytest

from atlas_lightning.errors import STOP_EXIT_CODES, CheckpointWriteError, RunStopped
from atlas_lightning.run.faults import DISK_ERRORS, stops_cleanly


def _stop(tmp_path, error: BaseException) -> RunStopped:
    with pytest.raises(RunStopped) as stopped, stops_cleanly(tmp_path, last_step=lambda: 7):
        raise error
    return stopped.value


@pytest.mark.parametrize("number", sorted(DISK_ERRORS), ids=errno.errorcode.get)
def test_a_refused_write_anywhere_is_the_write_stop(tmp_path, number):
    stop = _stop(tmp_path, OSError(number, os.strerror(number), str(tmp_path / "records.jsonl")))
    assert stop.exit_code == STOP_EXIT_CODES["write"] == 7
    assert str(stop).startswith("a file of the run could not be written after RL step 7 (the last one finished)")
    assert os.strerror(number) in str(stop) and "no complete checkpoint" in str(stop)
    assert ("free space on the file system of" in str(stop)) == (number in (errno.ENOSPC, errno.EDQUOT))
    assert ("give this user write permission on" in str(stop)) == (number in (errno.EACCES, errno.EPERM))


def test_a_checkpoint_that_could_not_be_written_is_the_write_stop(tmp_path):
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "global_step_8/lightning")
    error = CheckpointWriteError("the checkpoint of step 8 could not be written (rank 0: OSError: ...)")
    error.__cause__ = full
    stop = _stop(tmp_path, error)
    assert stop.cause == "write" and str(stop).startswith("a checkpoint could not be written after RL step 7")
    assert "free space on the file system of" in str(stop)


def test_a_write_failing_without_an_errno_names_the_free_space(tmp_path, monkeypatch):
    """torch's zip writer reports a full disk as a ``RuntimeError`` with no errno: the stop measures
    the free space against the last complete checkpoint and says to free it when it is short."""
    import shutil
    from collections import namedtuple

    from atlas_lightning.store.checkpoints import MARKER

    last = tmp_path / "global_step_6"
    (last / "lightning").mkdir(parents=True)
    (last / "lightning" / "state.ckpt").write_bytes(b"x" * 3 * 2**20)
    (last / MARKER).write_text("{}")
    error = CheckpointWriteError("the checkpoint of step 7 could not be written (rank 0: RuntimeError: "
                                 "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598)")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**40, 2**40 - 2**20, 2**20))
    stop = _stop(tmp_path, error)
    assert stop.cause == "write"
    assert (f"the file system of {tmp_path} has 1.0 MiB free, less than the last checkpoint's 3.0 MiB: free "
            f"space there before resuming") in str(stop)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**40, 2**39, 2**39))
    assert f"the file system of {tmp_path} has 512.0 GiB free (the last checkpoint took 3.0 MiB)" in str(_stop(tmp_path, error))


def test_another_os_error_is_no_write_stop(tmp_path):
    with pytest.raises(FileNotFoundError), stops_cleanly(tmp_path, last_step=lambda: 7):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", "x")
