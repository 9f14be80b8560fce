"""The shipped tiny orchestrator is what the project's own deterministic build makes: the suite
builds it anew (``orchestrator_dir``, beside the other tests) and every file's bytes must equal the
shipped ones (``demo/shipped_model.py``); ``data demo-model`` installs exactly those bytes."""

from __future__ import annotations

import json

from atlas_lightning.cli import main
from atlas_lightning.demo.shipped_model import WEIGHT_FILES, shipped_digests
from atlas_lightning.store.files import sha256_file


def test_the_build_reproduces_the_shipped_bytes(orchestrator_dir):
    built = {name: sha256_file(orchestrator_dir / name) for name in WEIGHT_FILES}
    assert built == shipped_digests(), ("the tiny orchestrator's build no longer makes the shipped bytes: re-make "
                                        "atlas_lightning/demo/tiny_orchestrator_model/ with `atlas-lightning data "
                                        "tiny-orchestrator --eval-questions 0` and re-measure the learning figures")


def test_demo_model_installs_the_shipped_files(tmp_path, capsys):
    assert main(["data", "demo-model", "--out", str(tmp_path / "model")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["files"] == shipped_digests()
    assert (tmp_path / "model" / "sft_summary.json").is_file()
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == sorted([*WEIGHT_FILES, "sft_summary.json"])
