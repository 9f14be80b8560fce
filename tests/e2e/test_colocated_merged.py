"""The colocated layout with merged weights, end to end on CPU through the CLI: ``fit
experiment=tiny-cpu rollout.weight_sync=merged`` with 1 MB buckets, so that bucket boundaries
fall inside the layers vLLM fuses (``qkv_proj``, ``gate_up_proj``). Every sync streams the
merged actor into the in-process engine in one reload and is verified (count, digest, probe
log-prob gap); loading bucket by bucket corrupted the split layers (``vllm_engine._reload_weights``).

The same launch meets a full disk: its ``main_ppo.log`` on a disk that refuses every line, and
its last step's checkpoint on a full disk (``FaultInjection``'s ``checkpoint_write``). It ends in
the write stop (exit 7) naming the full disk, with no traceback, the log's refusal said once
(the run log's handler, ``tests/run/test_run_log.py``). One launch for both: a launch costs
about 20 CPU-s before its first step."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.e2e]

NAME = "colo-merged"
STEPS = 2
FULL = Path("/dev/full")  # every write: ENOSPC


@pytest.mark.skipif(not FULL.exists(), reason="needs /dev/full")
def test_fit_syncs_merged_weights_into_the_in_process_engine_and_a_full_disk_ends_it_in_the_write_stop(
        tiny_model_dir, sample_data_dir, tmp_path):
    outputs = tmp_path / "outputs" / NAME
    outputs.mkdir(parents=True)
    (outputs / "main_ppo.log").symlink_to(FULL)
    command = [sys.executable, "-m", "atlas_lightning.cli", "fit", "experiment=tiny-cpu", f"name={NAME}",
               f"model.path={tiny_model_dir}", f"data.root={sample_data_dir}", f"paths.root={tmp_path}",
               "rollout.weight_sync=merged", "rollout.bucket_mb=1", f"trainer.total_steps={STEPS}",
               "trainer.save_every=1", "trainer.val_before_train=false", "trainer.val_every=100",
               "callbacks.validation.val_on_last_step=false", "rollout.n=2", "algorithm.train_batch_size=2",
               "algorithm.ppo_mini_batch_size=1", "rollout.max_tokens_per_turn=24", "logger.mode=disabled",
               "+callbacks.fault_injection._target_=atlas_lightning.callbacks.faults.FaultInjection",
               "+callbacks.fault_injection.fault=checkpoint_write", f"+callbacks.fault_injection.step={STEPS}"]
    env = dict(os.environ, OMP_NUM_THREADS="2", WANDB_MODE="disabled")
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)

    # the full disk: the write stop's line alone, the log's refusal said once
    assert done.returncode == 7, done.stderr[-4000:]
    assert "Traceback" not in done.stderr and "Logging error" not in done.stderr, done.stderr[-4000:]
    assert done.stderr.count(f"the run's log {outputs / 'main_ppo.log'} cannot be written") == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"atlas-lightning fit: stopped: a checkpoint could not be written after RL step {STEPS}"), last

    # the merged syncs, every step trained
    rows = []
    for path in sorted((Path(tmp_path) / "runs" / NAME).glob("*/history.csv")):
        rows += list(csv.DictReader(path.open()))
    assert sorted(int(float(r["training/rl_step"])) for r in rows if r.get("training/rl_step")) == [1, 2]
    gaps = [float(r["rollout/logprob_gap"]) for r in rows if r.get("rollout/logprob_gap")]
    counts = {float(r["rollout/sync_tensor_count"]) for r in rows if r.get("rollout/sync_tensor_count")}
    # the initial sync and one after each update, each within the fp32 gap of the LoRA sync
    assert len(gaps) == STEPS + 1 and max(gaps) < 1e-3
    assert counts == {46.0}  # every base tensor of the tiny model: 4 layers x 11, embedding, final norm (tied head)
