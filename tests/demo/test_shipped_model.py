"""The shipped tiny orchestrator is what the project's own deterministic build makes.

* Every run of the suite replays the build's first ``REPLAYED_STEPS`` training steps (the same
  base, demonstrations, order and learning rates as the whole build) and compares the weights'
  fingerprint with the one the build recorded in the shipped ``sft_summary.json`` at that step:
  a change of code or library that changes the build's path fails here in under a minute.
* ``make verify-demo-model`` (``pytest --full-build``) rebuilds the whole model (~13 CPU-minutes)
  and compares every file's bytes with the shipped ones (``demo/shipped_model.py``).
* ``data demo-model`` installs exactly those bytes.
"""

from __future__ import annotations

import json

import pytest

from atlas_lightning.cli import main
from atlas_lightning.demo.shipped_model import SHIPPED, WEIGHT_FILES, shipped_digests
from atlas_lightning.demo.tiny_orchestrator import (SUMMARY_FILE, TRAJECTORY_KEY, TRAJECTORY_STEPS,
                                                    replay_build_prefix)
from atlas_lightning.store.files import sha256_file

#: How many of the build's 800 steps the suite replays (a fingerprint is kept at this step).
REPLAYED_STEPS = 10

_REMAKE = ("re-make atlas_lightning/demo/tiny_orchestrator_model/ with `atlas-lightning data tiny-orchestrator "
           "--eval-questions 0` and re-measure the learning figures")


def _shipped_trajectory() -> dict:
    return json.loads((SHIPPED / SUMMARY_FILE).read_text(encoding="utf-8"))[TRAJECTORY_KEY]


def test_the_shipped_summary_fingerprints_the_whole_trajectory():
    trajectory = _shipped_trajectory()
    assert sorted(trajectory, key=int) == [str(step) for step in TRAJECTORY_STEPS]
    assert REPLAYED_STEPS in TRAJECTORY_STEPS
    assert len(set(trajectory.values())) == len(trajectory), "the weights must change between fingerprints"


def test_the_build_replays_the_shipped_trajectory():
    assert replay_build_prefix(REPLAYED_STEPS) == _shipped_trajectory()[str(REPLAYED_STEPS)], (
        f"the tiny orchestrator's build no longer follows the shipped model's path at step {REPLAYED_STEPS}: "
        + _REMAKE)


@pytest.mark.full_build
def test_the_build_reproduces_the_shipped_bytes(built_orchestrator_dir):
    built = {name: sha256_file(built_orchestrator_dir / name) for name in WEIGHT_FILES}
    assert built == shipped_digests(), "the tiny orchestrator's build no longer makes the shipped bytes: " + _REMAKE
    summary = json.loads((built_orchestrator_dir / SUMMARY_FILE).read_text(encoding="utf-8"))
    assert summary[TRAJECTORY_KEY] == _shipped_trajectory()


def test_demo_model_installs_the_shipped_files(tmp_path, capsys):
    assert main(["data", "demo-model", "--out", str(tmp_path / "model")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["files"] == shipped_digests()
    assert (tmp_path / "model" / "sft_summary.json").is_file()
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == sorted([*WEIGHT_FILES, "sft_summary.json"])
