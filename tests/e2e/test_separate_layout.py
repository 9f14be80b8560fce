"""The separate layout end to end on CPU, through the CLI: ``fit experiment=tiny-cpu
layout=separate_cpu rollout=vllm_server_cpu`` (training processes and one CPU vLLM server the
first of them starts), two training ranks with merged weights (vLLM's weight-transfer API) and
the decoupled PPO loss, 4 steps in two launches: SIGKILLed once step 2 is checkpointed (step 3
was sampled during update 2 and never trained), then ``trainer.resume=auto`` to the end.

Rollout k+1 is sampled during update k, staleness is logged every step and bounded, every weight
sync is verified, and the step records are complete; the kill ends the server too, and the
resume samples the prefetched step 3 again on the step-2 weights and trains it once: no step is
lost or counted twice. One run for both (each launch starts two trainers and a server, about
60 CPU-s): the uninterrupted steps are those of each launch. The LoRA sync in this layout runs
in ``test_kill_resume_partial.py``."""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from atlas_lightning.store.checkpoints import latest_complete
from atlas_lightning.store.records import read_record, verify_manifest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.e2e]

NAME = "sep"
STEPS = 4
RANKS = 2
#: Per step, across both launches: the weights version its rollout was sampled with, and its
#: staleness. Step 1 on the initial weights; step k+1 sampled during update k, one version
#: behind; step 3, the resume's first, sampled again on the step-2 weights it starts from.
VERSIONS = [0.0, 0.0, 2.0, 2.0]
STALENESS = [0.0, 1.0, 0.0, 1.0]


def _command(tiny_model_dir, sample_data_dir, root: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "atlas_lightning.cli", "fit", "experiment=tiny-cpu", f"name={NAME}",
            f"model.path={tiny_model_dir}", f"data.root={sample_data_dir}", f"paths.root={root}",
            "layout=separate_cpu", "rollout=vllm_server_cpu", "rollout.weight_sync=merged",
            f"layout.gpus={RANKS + 1}", f"layout.train_gpus={RANKS}", f"trainer.devices={RANKS}",
            "algorithm.off_policy_loss=decoupled", f"trainer.total_steps={STEPS}", "trainer.save_every=1",
            "trainer.val_before_train=false", "trainer.val_every=100", "callbacks.validation.val_on_last_step=false",
            "rollout.n=2", "algorithm.train_batch_size=2", "algorithm.ppo_mini_batch_size=1",
            "rollout.max_tokens_per_turn=24", "logger.mode=disabled", *extra]


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(2.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _history(root: Path) -> list[dict]:
    rows = []
    for path in sorted((root / "runs" / NAME).glob("*/history.csv")):
        rows += list(csv.DictReader(path.open()))
    return rows


@pytest.fixture(scope="module")
def killed_and_resumed(tiny_model_dir, sample_data_dir, tmp_path_factory) -> SimpleNamespace:
    """The two launches, and what the first left when it was killed: whether its server still
    answered 120 s later, whether step 3 had records, the checkpoint a resume finds."""
    root = tmp_path_factory.mktemp("separate")
    env = dict(os.environ, OMP_NUM_THREADS=str(2 // RANKS), WANDB_MODE="disabled")
    command = _command(tiny_model_dir, sample_data_dir, root)
    marker = root / "checkpoints" / NAME / "global_step_2" / "checkpoint.json"
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                               start_new_session=True)
    deadline = time.monotonic() + 900
    while not marker.exists():
        assert process.poll() is None, "the run ended before step 2 was checkpointed"
        assert time.monotonic() < deadline
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)  # both trainers; the server runs in a session of its own
    process.wait()
    # ... and stops all the same (the kernel signals it when its parent dies): nothing keeps its cards
    log_line = (root / "logs" / f"vllm-server-{NAME}-separate.log").read_text().splitlines()[0]
    port = int(log_line.split("--port ")[1].split()[0])
    deadline = time.monotonic() + 120
    while _listening(port) and time.monotonic() < deadline:
        time.sleep(1.0)
    killed = SimpleNamespace(server_answers=_listening(port), port=port,
                             step_3_records=(root / "artifacts" / NAME / "train" / "step_3").exists(),
                             resume_finds=latest_complete(root / "checkpoints" / NAME).name)

    resumed = subprocess.run(command + ["trainer.resume=auto"], capture_output=True, text=True, timeout=900, env=env)
    return SimpleNamespace(root=root, command=command, killed=killed, resumed=resumed)


def test_fit_in_the_separate_layout(killed_and_resumed):
    """``RANKS`` training processes (FSDP2 on gloo) share the one server; rank 0 sends the merged
    weights while rank 1 only takes part in the gathers, and both feed the server. The policy
    loss corrects for the stale rollouts (``algorithm.off_policy_loss=decoupled``)."""
    run, root = killed_and_resumed, killed_and_resumed.root
    assert run.resumed.returncode == 0, run.resumed.stderr[-4000:]

    rows = _history(root)
    steps = {int(float(r["training/rl_step"])): r for r in rows if r.get("training/rl_step")}
    assert sorted(steps) == list(range(1, STEPS + 1))
    staleness = [float(steps[k]["rollout/staleness"]) for k in range(1, STEPS + 1)]
    versions = [float(steps[k]["rollout/weights_version"]) for k in range(1, STEPS + 1)]
    assert staleness == STALENESS and versions == VERSIONS
    assert all(s <= 1 for s in staleness)  # layout.max_staleness
    # the staleness histogram of the 4 trajectories a step, none dropped, the idle shares
    hist = [(float(steps[k]["rollout/staleness_hist/0"]), float(steps[k]["rollout/staleness_hist/1"]))
            for k in range(1, STEPS + 1)]
    assert hist == [(4.0, 0.0) if s == 0 else (0.0, 4.0) for s in STALENESS]
    for k in range(1, STEPS + 1):
        assert float(steps[k]["rollout/dropped_trajectories"]) == 0.0
        assert 0.0 <= float(steps[k]["perf/trainer_idle_share"]) <= 1.0
        assert 0.0 <= float(steps[k]["perf/engine_idle_share"]) <= 1.0
    # step 1 is on-policy: the behaviour weights are 1 up to the merged weights' numerical gap
    assert abs(float(steps[1]["actor/behav_imp_weight_mean"]) - 1.0) < 1e-2
    # every sync verified: each launch's initial sync and one after each of its updates
    for path in sorted((root / "runs" / NAME).glob("*/history.csv")):
        launch = list(csv.DictReader(path.open()))
        gaps = [float(r["rollout/logprob_gap"]) for r in launch if r.get("rollout/logprob_gap")]
        updates = sum(1 for r in launch if r.get("training/rl_step"))
        assert len(gaps) == updates + 1 and max(gaps) < 1e-3, (path, gaps, updates)

    for step in range(1, STEPS + 1):
        folder = root / "artifacts" / NAME / "train" / f"step_{step}"
        assert verify_manifest(folder) == []
        manifest = json.loads((folder / "manifest.json").read_text())
        assert manifest["weights_version"] == versions[step - 1]
        records = [read_record(p) for p in folder.glob("*.json") if p.name != "manifest.json"]
        assert len(records) == 4 and {r.global_steps for r in records} == {step}
        for record in records:  # each generated token carries the version that sampled it
            assert record.response_versions.tolist() == [versions[step - 1] if m else -1
                                                         for m in record.response_mask.tolist()]
    server_log = (root / "logs" / f"vllm-server-{NAME}-separate.log").read_text()
    assert "weight-transfer-config" in server_log


def test_sigkill_then_resume_samples_the_prefetched_step_again(killed_and_resumed):
    """Killed once step 2 is checkpointed (step 3 was sampled during update 2 and never
    trained), ``trainer.resume=auto`` samples step 3 again (its questions, on the step-2
    weights) and trains it once: no step is lost or counted twice."""
    from atlas_lightning.config import compose
    from atlas_lightning.rollout.datamodule import RolloutDataModule

    run, root = killed_and_resumed, killed_and_resumed.root
    assert not run.killed.server_answers, f"the killed trainer's server still answers on port {run.killed.port}"
    assert not run.killed.step_3_records
    # what a resume finds: the newest folder with its marker (the kill may fall before the pointer
    # file, written after the marker, moved to 2)
    assert run.killed.resume_finds == "global_step_2"
    assert run.resumed.returncode == 0, run.resumed.stderr[-4000:]

    trained = [int(float(r["training/rl_step"])) for r in _history(root) if r.get("training/rl_step")]
    assert sorted(trained) == list(range(1, STEPS + 1))  # each step once, across both launches
    resumed = [r for r in _history(root) if r.get("training/rl_step") and float(r["training/rl_step"]) == 3][0]
    assert float(resumed["rollout/weights_version"]) == 2.0 and float(resumed["rollout/staleness"]) == 0.0
    cfg = compose(run.command[run.command.index("experiment=tiny-cpu"):])
    dm = RolloutDataModule(cfg, engine=object())  # no engine: only the sampler is read
    dm.setup("fit")
    expected = sorted(q.question_id for q in dm.steps.questions(3))
    folder = root / "artifacts" / NAME / "train" / "step_3"
    assert verify_manifest(folder) == []
    records = [read_record(p) for p in folder.glob("*.json") if p.name != "manifest.json"]
    assert sorted({r.question_id for r in records}) == expected and len(records) == 4
    for step in (3, STEPS):
        assert (root / "checkpoints" / NAME / f"global_step_{step}" / "checkpoint.json").is_file()
