"""The ``data`` verbs after a killed build: the next build removes what it left beside ``--out``
(never a running build's), and no half-built folder reads as a built one: a build moves into
``--out`` whole (``tiny-orchestrator``), or with the file that says it is whole last (the other
verbs: ``cli.BUILT_MARKERS``, the files ``make assets`` tests). The kills are simulated (a leftover
staging folder, a move interrupted): the whole 6-14 minute build never runs here."""

from __future__ import annotations

import fcntl
import json
import os
import re
from pathlib import Path

import pytest

from atlas_lightning import cli
from atlas_lightning.cli import BUILT_MARKERS, main
from atlas_lightning.demo import tiny_orchestrator
from atlas_lightning.demo.tiny_model import MODEL_FILES
from atlas_lightning.demo.tiny_orchestrator import SUMMARY_FILE, SFTRecipe
from atlas_lightning.store.staging import LOCK_FILE

#: A build of a few steps (``tests/demo/test_sft_training.py``'s), for the verb's whole path.
FEW_STEPS = SFTRecipe(demos_per_question=1, train_questions=2, steps=3, batch_size=2, warmup_steps=1,
                      eval_questions=0, val_loss_questions=1)


def _killed_build(parent: Path, name: str, suffix: str, *, swapping: bool = False) -> Path:
    """The staging folder a build killed part-way leaves beside ``parent/name``: its lock file
    (no living process holds it), a half-written model and, killed while swapping (``swapping``),
    the old folder it had moved aside."""
    folder = parent / f".{name}.staging-{suffix}"
    (folder / "out").mkdir(parents=True)
    (folder / LOCK_FILE).write_bytes(b"")
    (folder / "out" / "config.json").write_text("{}")
    (folder / "out" / "model.safetensors").write_bytes(b"\0" * 10)
    if swapping:
        (folder / "replaced").mkdir()
        (folder / "replaced" / SUMMARY_FILE).write_text("{}")
    return folder


def test_a_tiny_orchestrator_build_removes_what_a_killed_build_left_and_builds_whole(tmp_path, monkeypatch, capsys,
                                                                                      tiny_model_dir):
    monkeypatch.setattr(tiny_orchestrator, "DEFAULT_RECIPE", FEW_STEPS)
    out = tmp_path / "tiny-orchestrator"
    killed = _killed_build(tmp_path, out.name, "killed1")
    swapped = _killed_build(tmp_path, out.name, "killed2", swapping=True)  # out itself gone with it
    running = _killed_build(tmp_path, out.name, "running")
    with open(running / LOCK_FILE, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another build, still running
        assert main(["data", "tiny-orchestrator", "--out", str(out), "--base", str(tiny_model_dir),
                     "--eval-questions", "0"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 3
    assert not killed.exists() and not swapped.exists() and running.is_dir()
    assert sorted(p.name for p in out.iterdir()) == sorted([*MODEL_FILES, SUMMARY_FILE])
    assert sorted(p.name for p in tmp_path.iterdir()) == [running.name, out.name]


@pytest.mark.parametrize("verb", sorted(BUILT_MARKERS))
def test_a_data_build_removes_what_a_killed_build_left(verb, tmp_path, capsys):
    out = tmp_path / "assets" / verb
    out.parent.mkdir()
    killed = _killed_build(out.parent, out.name, "killed")
    assert main(["data", verb, "--out", str(out)]) == 0
    assert not killed.exists() and (out / BUILT_MARKERS[verb]).is_file()
    assert [p.name for p in out.parent.iterdir()] == [verb]


#: Each verb's output as a fixture of the session holds it (the same builders, the same seed).
_BUILT = {"sample": "sample_data_dir", "tiny-model": "tiny_model_dir", "demo-model": "orchestrator_dir"}


@pytest.mark.parametrize("verb", sorted(BUILT_MARKERS))
def test_a_data_build_killed_while_moving_leaves_no_folder_that_reads_as_built(verb, tmp_path, monkeypatch, request):
    """Killed after moving every file but one into ``--out``: the one missing is the marker, so
    ``make assets`` (which tests it) builds again; the next build completes the folder."""
    whole = request.getfixturevalue(_BUILT[verb])
    files = sum(1 for p in whole.rglob("*") if p.is_file())
    out = tmp_path / verb
    moved = []
    real_replace = os.replace

    def replace(source, target):
        if not Path(target).is_relative_to(out):  # a builder's own atomic writes, in its staging folder
            return real_replace(source, target)
        if len(moved) == files - 1:
            raise KeyboardInterrupt  # the kill, as late as it can come
        moved.append(Path(target).relative_to(out).as_posix())
        real_replace(source, target)

    monkeypatch.setattr(cli.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        cli._run_data(cli.parse_args(["data", verb, "--out", str(out)]))
    assert len(moved) == files - 1 and BUILT_MARKERS[verb] not in moved
    assert not (out / BUILT_MARKERS[verb]).exists()
    monkeypatch.setattr(cli.os, "replace", real_replace)
    assert main(["data", verb, "--out", str(out)]) == 0
    assert {p.relative_to(out) for p in out.rglob("*")} == {p.relative_to(whole) for p in whole.rglob("*")}


def test_make_assets_tests_the_file_each_verb_moves_last():
    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    tested = re.findall(r"test -f \$\(CACHE\)/[\w-]+/(\S+) \|\|\s*\\?\s*\$\(BIN\)/atlas-lightning data ([\w-]+)",
                        makefile)
    assert {verb: marker for marker, verb in tested} == BUILT_MARKERS


def test_a_tiny_orchestrator_build_into_a_folder_of_other_files_is_refused_before_it_builds(tmp_path, capsys,
                                                                                            monkeypatch):
    """The build replaces ``--out`` whole: a folder holding files it does not write (the user's
    own model, say) is refused at once, naming them, and left as it was."""
    monkeypatch.setattr(tiny_orchestrator, "build_tiny_orchestrator", lambda *a, **k: pytest.fail("it built"))
    out = tmp_path / "models"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "my-notes.txt").write_text("mine")
    (out / "qwen3-8b").mkdir()
    assert main(["data", "tiny-orchestrator", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: holds my-notes.txt, qwen3-8b, which this build does not write" in err, err
    assert "Traceback" not in err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "my-notes.txt", "qwen3-8b"]
    assert [p.name for p in tmp_path.iterdir()] == ["models"]
