"""``trainer.precision`` other than Lightning's ``32-true`` is refused by every command that
composes a config, as any bad value is: exit 2, one line naming the key, what is accepted and
the key to use instead (``model.dtype``), no traceback, nothing written. The trainer's dtypes are
``model.dtype``'s and FSDP2's policy (``models/sharding.py``); Lightning's other plugins cast the
whole module or autocast the update (``bf16-mixed`` on CPU failed in step 1's update, after the
run's config, record and adapters were written)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from atlas_lightning.config import ConfigError, compose

SAID = ("trainer.precision='bf16-mixed': is not one of 32-true, 32 (the base's dtype is model.dtype (bfloat16, "
        "float16 or float32); LoRA masters stay float32, and on GPUs FSDP2 computes in bfloat16 (models/sharding.py))")


def _commands(out, root) -> list:
    run = ["experiment=tiny-cpu", f"paths.root={root}", "trainer.precision=bf16-mixed"]
    return [
        ("atlas_lightning.cli", ["fit", *run], "atlas-lightning fit"),
        ("atlas_lightning.cli", ["validate", *run], "atlas-lightning validate"),
        ("atlas_lightning.cli", ["memory-check", *run], "atlas-lightning memory-check"),
        ("atlas_lightning.bench.step", ["--out", str(out), "--", *run], "python -m atlas_lightning.bench.step"),
    ]


@pytest.mark.parametrize("index", range(4), ids=["fit", "validate", "memory-check", "bench.step"])
def test_another_lightning_precision_exits_2_naming_model_dtype(tmp_path, index):
    out, root = tmp_path / "out", tmp_path / "root"
    module, argv, program = _commands(out, root)[index]
    done = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert lines == [f"{program}: config error: {SAID}"], lines
    assert not out.exists() and not root.exists()


@pytest.mark.parametrize("precision", ["bf16-true", "16-true", "16-mixed", "64-true", "64", "transformer-engine"])
def test_every_other_precision_is_refused(precision):
    with pytest.raises(ConfigError, match=f"trainer.precision='{precision}': is not one of 32-true, 32 "):
        compose(["experiment=tiny-cpu", f"trainer.precision={precision}"])


@pytest.mark.parametrize("precision", ["32-true", "32"])
def test_full_precision_is_accepted(precision):
    assert compose(["experiment=tiny-cpu", f"trainer.precision={precision}"]).trainer.precision == precision
