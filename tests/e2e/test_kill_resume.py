"""Crash and resume through the CLI: SIGKILL during step 3, then ``fit trainer.resume=auto``,
gives the same step-3 records as an uninterrupted run, and nothing half-written stays visible."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from atlas_lightning.store.checkpoints import latest_complete
from atlas_lightning.store.records import read_record, read_step_tensors, verify_manifest
from tests.e2e.kill_harness import kill_once_written, run_to_end

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NAME = "kr"


def _command(tiny_model_dir, sample_data_dir, root: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "atlas_lightning.cli", "fit", "experiment=tiny-cpu", f"name={NAME}",
            f"model.path={tiny_model_dir}", f"data.root={sample_data_dir}", f"paths.root={root}",
            "trainer.total_steps=3", "trainer.save_every=1", "trainer.val_before_train=false", "trainer.val_every=100",
            "callbacks.validation.val_on_last_step=false", "rollout.n=2", "algorithm.train_batch_size=2",
            "algorithm.ppo_mini_batch_size=1", "rollout.max_tokens_per_turn=24", "logger.mode=disabled", *extra]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="2", WANDB_MODE="disabled")


def _records(root: Path, step: int) -> dict:
    folder = root / "artifacts" / NAME / "train" / f"step_{step}"
    assert verify_manifest(folder) == []
    return {p.name: read_record(p) for p in sorted(folder.glob("*.json")) if p.name != "manifest.json"}


def test_sigkill_mid_step_then_resume_gives_the_uninterrupted_records(tiny_model_dir, sample_data_dir, tmp_path):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    run_to_end(_command(tiny_model_dir, sample_data_dir, straight), _env())
    # Run again and kill it once step 2's checkpoint is complete (step 3 is then under way).
    marker = crashed / "checkpoints" / NAME / "global_step_2" / "checkpoint.json"
    kill_once_written(_command(tiny_model_dir, sample_data_dir, crashed), _env(), marker)

    # Nothing of step 3 looks complete.
    assert not (crashed / "checkpoints" / NAME / "global_step_3" / "checkpoint.json").exists()
    assert not (crashed / "artifacts" / NAME / "train" / "step_3").exists()
    # what a resume finds: the newest folder with its marker (the kill may fall before the
    # ``latest_checkpointed_iteration.txt`` pointer, written after the marker, moved to 2)
    assert latest_complete(crashed / "checkpoints" / NAME).name == "global_step_2"

    result = subprocess.run(_command(tiny_model_dir, sample_data_dir, crashed, "trainer.resume=auto"),
                            capture_output=True, text=True, timeout=900, env=_env())
    assert result.returncode == 0, result.stderr[-4000:]

    for step in (1, 2, 3):
        expected, got = _records(straight, step), _records(crashed, step)
        assert expected.keys() == got.keys(), step
        for name, record in expected.items():
            other = got[name]
            assert other.question_id == record.question_id and other.global_steps == step
            assert other.reward_score == pytest.approx(record.reward_score, abs=1e-9)
            assert other.episode["terminal_reason"] == record.episode["terminal_reason"]
    a = read_step_tensors(straight / "artifacts" / NAME / "train" / "step_3" / "tensors.npz")
    b = read_step_tensors(crashed / "artifacts" / NAME / "train" / "step_3" / "tensors.npz")
    for key in ("response_ids", "response_mask"):
        assert [x.tolist() for x in a[key]] == [x.tolist() for x in b[key]], key
    for key in ("values", "advantages", "response_logprobs"):
        for x, y in zip(a[key], b[key]):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)
    marker3 = json.loads((crashed / "checkpoints" / NAME / "global_step_3" / "checkpoint.json").read_text())
    assert marker3["global_step"] == 3
