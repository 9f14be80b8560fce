"""The callbacks under two real DDP processes (gloo): every rank takes part in the collectives,
rank 0 writes the records of both ranks, and a non-finite step stops both ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from atlas_lightning.store.records import read_record, verify_manifest

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("ddp_worker.py")
#: torchrun's rendezvous for the two ranks, forked after one import of the worker's modules.
FORKED_RANKS = Path(__file__).resolve().parents[1] / "forked_ranks.py"


def _launch(root: Path, name: str, nan_step: int) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run(
        [sys.executable, str(FORKED_RANKS), "2", str(WORKER), str(root), name, str(nan_step)],
        capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((root / f"{name}_rank_{r}.json").read_text()) for r in (0, 1)]


def test_two_ranks_write_one_tree(tmp_path):
    ranks = _launch(tmp_path, "ddp", nan_step=0)
    assert [r["error"] for r in ranks] == [None, None]
    assert [r["val_calls"] for r in ranks] == [[0, 2, 3], [0, 2, 3]]  # validation is collective
    assert ranks[0]["logged_steps"] == [0, 2, 3] and ranks[1]["logged_steps"] == []

    artifacts = tmp_path / "artifacts" / "ddp"
    run = json.loads((artifacts / "run.json").read_text())
    assert run["hosts"]["world_size"] == 2 and [h["rank"] for h in run["hosts"]["ranks"]] == [0, 1]
    for step in (1, 2, 3):
        folder = artifacts / "train" / f"step_{step}"
        assert verify_manifest(folder) == []
        uids = {read_record(p).uid for p in folder.glob("*_*.json")}
        assert uids == {"gpqa-gt1", "gpqa-gt2", "lcb-lt1"}  # rank 0 has gt1 and lt1, rank 1 gt2
    val = {read_record(p).uid for p in (artifacts / "val" / "step_2").glob("*_*.json")}
    assert val == {"gpqa-gv1", "gpqa-gv2", "gpqa-gv3", "lcb-lv1", "lcb-lv2"}
    dump = (tmp_path / "checkpoints" / "ddp" / "global_step_2" / "val_dumps" / "2.jsonl").read_text().splitlines()
    assert len(dump) == 5
    terminal = json.loads((artifacts / "train_figures" / "terminal_reasons.json").read_text())
    assert [s["total"] for s in terminal["steps"]] == [6, 6, 6]


@pytest.mark.e2e  # a fault on one rank stopping both in make test: tests/run/test_rank_faults.py
def test_a_nonfinite_step_stops_both_ranks(tmp_path):
    ranks = _launch(tmp_path, "nan", nan_step=3)
    good = tmp_path / "checkpoints" / "nan" / "global_step_2"
    for outcome in ranks:
        assert outcome["error"] is not None and outcome["error"].startswith("step 3: non-finite actor/entropy")
        assert f"the last good checkpoint is {good}" in outcome["error"]
    report = json.loads((tmp_path / "artifacts" / "nan" / "nonfinite" / "step_3.json").read_text())
    # Each rank named its own first trajectory with a count of 3.
    assert report["counts"] == {"actor/entropy": 6} and len(report["trajectories"]) == 2
    assert len(report["by_rank"]) == 2
    assert not (tmp_path / "artifacts" / "nan" / "train" / "step_3").exists()
