"""The separate layout end to end on CPU, through the CLI: ``fit experiment=tiny-cpu
layout=separate_cpu rollout=vllm_server_cpu`` (one training process, one CPU vLLM server it
starts), 3 steps. Rollout k+1 is sampled during update k, staleness is logged every step and
bounded, every weight sync is verified (merged weights through vLLM's weight-transfer API, or
the LoRA adapter), and the step records are complete."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from atlas_lightning.records import read_record, verify_manifest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NAME = "sep"
STEPS = 3


def _command(tiny_model_dir, sample_data_dir, root: Path, weight_sync: str) -> list[str]:
    return [sys.executable, "-m", "atlas_lightning.cli", "fit", "experiment=tiny-cpu", f"name={NAME}",
            f"model.path={tiny_model_dir}", f"data.root={sample_data_dir}", f"paths.root={root}",
            "layout=separate_cpu", "rollout=vllm_server_cpu", f"rollout.weight_sync={weight_sync}",
            f"trainer.total_steps={STEPS}", "trainer.save_every=2", "trainer.val_before_train=false",
            "trainer.val_every=100", "callbacks.validation.val_on_last_step=false", "rollout.n=2",
            "algorithm.train_batch_size=2", "algorithm.ppo_mini_batch_size=1", "rollout.max_tokens_per_turn=24",
            "logger.mode=disabled"]


def _history(root: Path) -> list[dict]:
    (path,) = (root / "runs" / NAME).glob("*/history.csv")
    return list(csv.DictReader(path.open()))


@pytest.mark.parametrize("weight_sync", ["merged", "lora"])
def test_fit_in_the_separate_layout(weight_sync, tiny_model_dir, sample_data_dir, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="2", WANDB_MODE="disabled")
    result = subprocess.run(_command(tiny_model_dir, sample_data_dir, tmp_path, weight_sync), capture_output=True,
                            text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-4000:]

    rows = _history(tmp_path)
    steps = {int(float(r["training/rl_step"])): r for r in rows if r.get("training/rl_step")}
    assert sorted(steps) == list(range(1, STEPS + 1))
    staleness = [float(steps[k]["rollout/staleness"]) for k in range(1, STEPS + 1)]
    versions = [float(steps[k]["rollout/weights_version"]) for k in range(1, STEPS + 1)]
    # step 1 on the initial weights; then step k+1 was sampled during update k, one version behind
    assert staleness == [0.0, 1.0, 1.0] and versions == [0.0, 0.0, 1.0]
    assert all(s <= 1 for s in staleness)  # layout.max_staleness
    gaps = [float(r["rollout/logprob_gap"]) for r in rows if r.get("rollout/logprob_gap")]
    assert len(gaps) == STEPS + 1 and max(gaps) < 1e-3  # the initial sync and one after each update

    for step in range(1, STEPS + 1):
        folder = tmp_path / "artifacts" / NAME / "train" / f"step_{step}"
        assert verify_manifest(folder) == []
        manifest = json.loads((folder / "manifest.json").read_text())
        assert manifest["weights_version"] == versions[step - 1]
        records = [read_record(p) for p in folder.glob("*.json") if p.name != "manifest.json"]
        assert len(records) == 4 and {r.global_steps for r in records} == {step}
    for step in (2, 3):
        assert (tmp_path / "checkpoints" / NAME / f"global_step_{step}" / "checkpoint.json").is_file()
    server_log = (tmp_path / "logs" / f"vllm-server-{NAME}-separate.log").read_text()
    assert ("weight-transfer-config" in server_log) == (weight_sync == "merged")
