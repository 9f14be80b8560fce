"""The tiny orchestrator as the project ships it: the bytes its own deterministic build
(``tiny_orchestrator.build_tiny_orchestrator``, seed 0, ``DEFAULT_RECIPE``) writes, so that the
embedded default starts in seconds instead of a 6-14 minute SFT on two cores.

    atlas-lightning data demo-model --out DIR      # what `make demo` installs
    atlas-lightning data tiny-orchestrator --out DIR --eval-questions 0   # the build, to re-make it

The test suite replays the build's first steps against the shipped losses, and ``make
verify-demo-model`` rebuilds it whole and compares its losses and weights within a tolerance
(``tests/demo/test_shipped_model.py``; the weights' bytes are one CPU's): a change of code or
library that changes the build's path fails there, so the shipped model is never other than what
the build makes (the README's learning figures were measured on it). An install whose copy does
not hash as the shipped files do is refused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from atlas_lightning.demo.tiny_model import MODEL_FILES
from atlas_lightning.demo.tiny_orchestrator import SUMMARY_FILE
from atlas_lightning.store.files import sha256_file
from atlas_lightning.store.atomic import atomic_write_text

#: The package folder holding the shipped files.
SHIPPED = Path(__file__).resolve().parent / "tiny_orchestrator_model"
#: The files the build writes whose bytes the build determines (its summary holds timings too).
WEIGHT_FILES = tuple(MODEL_FILES)


def shipped_digests() -> dict[str, str]:
    """``{file: sha256}`` of the shipped model files (``WEIGHT_FILES``)."""
    return {name: sha256_file(SHIPPED / name) for name in WEIGHT_FILES}


def install_shipped_model(out: str | Path) -> dict:
    """Copy the shipped tiny orchestrator into ``out`` (made if needed; files replaced) and
    return ``{"out", "files": {name: sha256}}``, the summary last so that a half-copied folder is
    never taken for a whole one (``make demo`` checks for it)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in WEIGHT_FILES:
        shutil.copyfile(SHIPPED / name, out / name)
    digests = {name: sha256_file(out / name) for name in WEIGHT_FILES}
    if digests != shipped_digests():
        raise OSError(f"{out}: the copy of the shipped tiny orchestrator does not match it (a full disk?)")
    summary = json.loads((SHIPPED / SUMMARY_FILE).read_text(encoding="utf-8"))
    atomic_write_text(out / SUMMARY_FILE, json.dumps({**summary, "installed_from": "the shipped build"}, indent=2) + "\n")
    return {"out": str(out), "files": digests}
