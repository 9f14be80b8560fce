"""The colocated layout with merged weights, end to end on CPU through the CLI: ``fit
experiment=tiny-cpu rollout.weight_sync=merged`` with 1 MB buckets, so that bucket boundaries
fall inside the layers vLLM fuses (``qkv_proj``, ``gate_up_proj``). Every sync streams the
merged actor into the in-process engine in one reload and is verified (count, digest, probe
log-prob gap); loading bucket by bucket corrupted the split layers (``vllm_engine._reload_weights``)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NAME = "colo-merged"
STEPS = 2


def test_fit_syncs_merged_weights_into_the_in_process_engine(tiny_model_dir, sample_data_dir, tmp_path):
    command = [sys.executable, "-m", "atlas_lightning.cli", "fit", "experiment=tiny-cpu", f"name={NAME}",
               f"model.path={tiny_model_dir}", f"data.root={sample_data_dir}", f"paths.root={tmp_path}",
               "rollout.weight_sync=merged", "rollout.bucket_mb=1", f"trainer.total_steps={STEPS}",
               "trainer.save_every=100", "trainer.val_before_train=false", "trainer.val_every=100",
               "callbacks.validation.val_on_last_step=false", "rollout.n=2", "algorithm.train_batch_size=2",
               "algorithm.ppo_mini_batch_size=1", "rollout.max_tokens_per_turn=24", "logger.mode=disabled"]
    env = dict(os.environ, OMP_NUM_THREADS="2", WANDB_MODE="disabled")
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = []
    for path in sorted((Path(tmp_path) / "runs" / NAME).glob("*/history.csv")):
        rows += list(csv.DictReader(path.open()))
    gaps = [float(r["rollout/logprob_gap"]) for r in rows if r.get("rollout/logprob_gap")]
    counts = {float(r["rollout/sync_tensor_count"]) for r in rows if r.get("rollout/sync_tensor_count")}
    # the initial sync and one after each update, each within the fp32 gap of the LoRA sync
    assert len(gaps) == STEPS + 1 and max(gaps) < 1e-3
    assert counts == {46.0}  # every base tensor of the tiny model: 4 layers x 11, embedding, final norm (tied head)
