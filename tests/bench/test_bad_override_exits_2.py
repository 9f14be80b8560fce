"""Every command that composes a config or runs ``fit`` refuses a bad override as ``atlas-lightning
fit`` does (``run/exit_codes.py``): exit 2, one line on stderr naming the program and the key, no
traceback, nothing written under its output folder or the run's root. Each is run as a user runs
it (``python -m ...``); the refusal comes from compose, before any model or engine is touched."""

from __future__ import annotations

import subprocess
import sys

import pytest

BAD = "trainer.max_step=3"  # trainer.max_steps is not a key either: trainer.total_steps is


def _commands(out, root) -> list:
    return [
        ("atlas_lightning.cli", ["fit", "experiment=tiny-cpu", f"paths.root={root}", BAD], "atlas-lightning fit"),
        ("atlas_lightning.bench.step", ["--out", str(out), "--", "experiment=tiny-cpu", f"paths.root={root}", BAD],
         "python -m atlas_lightning.bench.step"),
        ("atlas_lightning.bench.learning", ["--root", str(root), "--seeds", "0", "--", BAD],
         "python -m atlas_lightning.bench.learning"),
        ("atlas_lightning.bench.step_suite", ["a", "b", "--out", str(out), "--runs", str(root), "--extra", BAD],
         "atlas-lightning bench step-suite"),
    ]


@pytest.mark.parametrize("index", range(4), ids=["cli fit", "bench.step", "bench.learning", "bench.step_suite"])
def test_a_bad_override_exits_2_with_one_line_naming_the_key(tmp_path, index):
    out, root = tmp_path / "out", tmp_path / "root"
    module, argv, program = _commands(out, root)[index]
    done = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"{program}: config error: ") and "trainer.max_step" in lines[0], lines
    assert not out.exists() and not root.exists()
