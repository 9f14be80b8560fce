"""Staging folders (``store/staging.py``): what a killed build left is removed by the next build,
a running build's never; a build moves into place whole."""

from __future__ import annotations

import fcntl
import os

import pytest

from atlas_lightning.store.staging import LOCK_FILE, remove_leftovers, replace_folder, staging_folder, staging_folders


def _killed_build(parent, name, suffix="killed"):
    """A staging folder as a build killed part-way leaves it: its lock file (no process holds it
    now) and a half-written output."""
    folder = parent / f".{name}.staging-{suffix}"
    (folder / "out").mkdir(parents=True)
    (folder / LOCK_FILE).write_bytes(b"")
    (folder / "out" / "config.json").write_text("{}")
    (folder / "out" / "model.safetensors").write_bytes(b"\0" * 10)  # cut short
    return folder


def test_a_killed_builds_staging_folder_goes_and_a_running_builds_stays(tmp_path):
    killed = _killed_build(tmp_path, "model")
    running = _killed_build(tmp_path, "model", "running")
    other = _killed_build(tmp_path, "other-model")  # another destination's: not this build's to judge
    unlocked = tmp_path / ".model.staging-unlocked"  # no lock file: made this instant, or not ours
    unlocked.mkdir()
    with open(running / LOCK_FILE, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the running build holds it
        with staging_folder(tmp_path, "model") as mine:
            assert not killed.exists()
            assert running.is_dir() and other.is_dir() and unlocked.is_dir()
            assert mine.name.startswith(".model.staging-") and (mine / LOCK_FILE).is_file()
            # while this build runs, the next one leaves its folder alone too
            assert remove_leftovers(tmp_path, "model") == []
            assert set(staging_folders(tmp_path, "model")) == {mine, running, unlocked}
        assert not mine.exists()  # a build's own staging folder goes when it ends
    assert remove_leftovers(tmp_path, "model") == [running]  # once its build is gone
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.staging-unlocked", ".other-model.staging-killed"]


def test_a_build_that_fails_leaves_no_staging_folder(tmp_path):
    with pytest.raises(RuntimeError, match="build failed"), staging_folder(tmp_path / "made", "model") as work:
        (work / "out").mkdir()
        raise RuntimeError("build failed")
    assert list((tmp_path / "made").iterdir()) == []


def test_a_staging_folder_is_never_the_destination(tmp_path):
    """Nothing reading ``<parent>/<name>`` (or listing visible folders) can take a staging folder for it."""
    with staging_folder(tmp_path, "sample-data") as work:
        assert work.parent == tmp_path and work.name != "sample-data" and work.name.startswith(".")
        assert not (tmp_path / "sample-data").exists()


def test_replace_folder_swaps_the_whole_folder(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with staging_folder(tmp_path, "model") as work:
        built = work / "out"
        built.mkdir()
        (built / "new.txt").write_text("new")
        replace_folder(built, out, work)
        assert sorted(p.name for p in out.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # what it replaced went with the staging
    (tmp_path / "afile").write_text("x")
    with staging_folder(tmp_path, "afile") as work, pytest.raises(NotADirectoryError, match="not a folder"):
        (work / "out").mkdir()
        replace_folder(work / "out", tmp_path / "afile", work)


def test_a_running_builds_lock_holds_against_a_build_in_another_process(tmp_path):
    """The next build runs in another process (a second ``make demo``): the running build's lock
    keeps its staging folder from it (a forked child: its locks are its own)."""
    with staging_folder(tmp_path, "model") as mine:
        pid = os.fork()
        if pid == 0:  # the next build, in another process
            os._exit(0 if remove_leftovers(tmp_path, "model") == [] and mine.exists() else 1)
        assert os.waitpid(pid, 0)[1] == 0
