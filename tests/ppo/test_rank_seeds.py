"""LoRA dropout under FSDP2 data parallelism: every rank draws masks of its own (its torch
generators seeded from the run seed and its rank, ``ppo/rng_state.seed_training``), and a rerun
draws the same masks again. Two ranks on gloo, fed the same batches: ranks whose generators
stood in one state would draw the same masks (every rank used to)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.e2e]  # two ranks, twice: make test-e2e

WORKER = Path(__file__).with_name("dropout_masks_worker.py")
FORKED_RANKS = Path(__file__).resolve().parents[1] / "forked_ranks.py"


def _masks(model: Path, root: Path) -> list[list[str]]:
    root.mkdir()
    done = subprocess.run([sys.executable, str(FORKED_RANKS), "2", str(WORKER), str(model), str(root)],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((root / f"masks-{rank}.json").read_text()) for rank in (0, 1)]


def test_each_rank_draws_its_own_dropout_masks_and_a_rerun_draws_them_again(tiny_model_dir, tmp_path):
    first = _masks(tiny_model_dir, tmp_path / "first")
    assert first[0] and len(first[0]) == len(first[1])  # the same calls on both ranks
    assert not set(first[0]) & set(first[1])  # no mask drawn on rank 0 is drawn on rank 1
    assert _masks(tiny_model_dir, tmp_path / "again") == first
