"""Lossless resume with partial rollouts, through the CLI and a CPU vLLM server: ``fit
layout=separate_cpu rollout=vllm_server_cpu layout.partial_rollouts=true``, SIGKILL once step 2 is
checkpointed (steps 3 and 4 are then sampled or under way), then ``trainer.resume=auto``.

Counted against what an uninterrupted run trains (each step trains its own prompts: the data
module's sampler and trajectories for steps 1-4, read without an engine): the multiset of trained
(step, uid, session) is the same (0 prompts skipped, 0 trained twice), and every token the
checkpoint kept in flight (``global_step_2/inflight/``, listed in its ``checkpoint.json``) is in
the resumed run's trained records, with its log-prob and version: 0 tokens generated again. The
comparison is by prompt: a re-prefilled continuation samples anew where a sync or the checkpoint's
cut interrupted a turn, so tokens differ from an uninterrupted run's."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from atlas_lightning.rollout import inflight
from atlas_lightning.store.checkpoints import verify_checkpoint
from atlas_lightning.store.records import read_step_tensors, verify_manifest
from tests.e2e.kill_harness import kill_once_written

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.e2e]

NAME = "krp"
STEPS = 4


def _command(tiny_model_dir, sample_data_dir, root: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "atlas_lightning.cli", "fit", "experiment=tiny-cpu", f"name={NAME}",
            f"model.path={tiny_model_dir}", f"data.root={sample_data_dir}", f"paths.root={root}",
            "layout=separate_cpu", "rollout=vllm_server_cpu", "layout.partial_rollouts=true",
            "algorithm.off_policy_loss=decoupled", f"trainer.total_steps={STEPS}", "trainer.save_every=1",
            "trainer.val_before_train=false", "trainer.val_every=100", "callbacks.validation.val_on_last_step=false",
            "rollout.n=2", "algorithm.train_batch_size=2", "algorithm.ppo_mini_batch_size=1",
            "rollout.max_tokens_per_turn=48", "logger.mode=disabled", *extra]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")


def uninterrupted_keys(command: list[str]) -> collections.Counter:
    """The (step, uid, session) each step of an uninterrupted run trains, once each."""
    from atlas_lightning.config import compose
    from atlas_lightning.rollout.datamodule import RolloutDataModule

    dm = RolloutDataModule(compose(command[command.index("experiment=tiny-cpu"):]), engine=object())
    dm.setup("fit")  # no engine: only the sampler and the trajectories' identities are read
    return collections.Counter((step, traj.uid, traj.session_id)
                               for step in range(1, STEPS + 1) for traj in dm.train_trajectories(step))


def trained(root: Path) -> dict:
    """``{(step, uid, session): (response_ids, response_logprobs)}`` of every trained step, and the
    multiset of those keys (a key trained twice counts twice)."""
    out, keys = {}, collections.Counter()
    for step in range(1, STEPS + 1):
        folder = root / "artifacts" / NAME / "train" / f"step_{step}"
        assert verify_manifest(folder) == []
        tensors = read_step_tensors(folder / "tensors.npz")
        for i, (uid, session) in enumerate(zip(tensors["uid"], tensors["session_id"])):
            keys[(step, uid, session)] += 1
            out[(step, uid, session)] = (tensors["response_ids"][i].tolist(), tensors["response_logprobs"][i])
    return out, keys


def regenerated_tokens(kept: dict, got: dict) -> int:
    """Tokens the checkpoint kept that the trained records do not hold as they were kept."""
    lost = 0
    for step, opened in kept.items():
        for traj in opened.trajectories:
            ids, logprobs = got[(step, traj.uid, traj.session_id)]
            saved = list(traj.response_ids)
            same = ids[:len(saved)] == saved and np.allclose(logprobs[:len(saved)], traj.response_logprobs)
            lost += 0 if same else int(sum(traj.response_mask))
    return lost


def test_sigkill_then_resume_regenerates_skips_and_repeats_nothing(tiny_model_dir, sample_data_dir, tmp_path):
    crashed = tmp_path / "crashed"
    marker = crashed / "checkpoints" / NAME / "global_step_2" / "checkpoint.json"
    kill_once_written(_command(tiny_model_dir, sample_data_dir, crashed), _env(), marker)

    folder = marker.parent
    listed = json.loads(marker.read_text())["files"]
    assert any(name.startswith("inflight/") for name in listed)
    verify_checkpoint(folder)  # the in-flight files too, by their sha256
    kept = inflight.restore(folder)
    assert kept and min(kept) == 3 and inflight.saved_tokens(kept) > 0

    result = subprocess.run(_command(tiny_model_dir, sample_data_dir, crashed, "trainer.resume=auto"),
                            capture_output=True, text=True, timeout=900, env=_env())
    assert result.returncode == 0, result.stderr[-4000:]

    expected_keys = uninterrupted_keys(_command(tiny_model_dir, sample_data_dir, crashed))
    got, got_keys = trained(crashed)
    skipped = expected_keys - got_keys
    duplicated = got_keys - expected_keys
    regenerated = regenerated_tokens(kept, got)
    print(f"kept in flight: steps {sorted(kept)}, {sum(len(o.trajectories) for o in kept.values())} trajectories "
          f"({sum(not t.done for o in kept.values() for t in o.trajectories)} open), "
          f"{inflight.saved_tokens(kept)} generated tokens; trained {sum(got_keys.values())} (uninterrupted "
          f"{sum(expected_keys.values())}); skipped {sum(skipped.values())}, duplicated {sum(duplicated.values())}, "
          f"regenerated {regenerated}")
    assert (sum(skipped.values()), sum(duplicated.values())) == (0, 0), (skipped, duplicated)
    assert max(got_keys.values()) == 1
    assert regenerated == 0
