"""Faults part-way through a fit, through the CLI: the engine killed in the middle of a rollout,
at a weight sync and in the middle of a validation, out of memory in the middle of an update, a
NaN during an update, the disk full while a checkpoint is written, the trainer SIGKILLed and
SIGTERMed. Each fault ends in a clean stop that names its cause (exit 4, 5, 6, 7, 143; no traceback;
``run/faults.py``), leaves the last complete checkpoint intact (it verifies against its
``checkpoint.json`` and its state is whole) and the next launch resumes from it. The faults are
injected by ``callbacks/faults.py`` (``FaultInjection``).

One chain per machine, each launch resuming the last. On CPU: out of memory at step 2
(checkpoint 1 left); SIGKILL once step 2 is checkpointed (step 3 under way: nothing of it looks
complete); SIGTERM in step 3's rollout (the step finishes, checkpoint 3; exit 143); a NaN at
step 4 (checkpoint 3); the engine killed in step 4's rollout (checkpoint 3); then a clean
resume to the end (checkpoint 4). SIGINT and the user's own code raising take the same stop
(``run/faults.py``; exit 130 and 8) and are tried in process, without a launch each, to keep the
suite's time: ``tests/run/test_interrupts.py``, ``tests/run/test_user_code.py``. Its step records are those of an uninterrupted
run of the same fit (every resume, the one after the SIGKILL included, continues exactly). On
the card: out of memory at step 2, a NaN at step 3, then launches that each fail step 4 from
checkpoint 3: the engine killed in its rollout, at its weight sync (the probe meets the dead
engine), in its validation (the launch validates at step 4) and with the disk full as its
checkpoint is written (found at fit's end: the marker never written); then a clean resume.
The CPU chain runs in the normal suite (tiny model, vLLM's CPU engine, a real allocation failure is impossible there: ``torch.OutOfMemoryError`` is raised at
the injection point). The card chain runs the same on a GPU (``experiment=h200-tiny``: FSDP2 at
world 1, the in-process vLLM engine asleep during updates, a bf16 base: the NaN comes in a bf16
update; the out-of-memory is a real CUDA allocation larger than the card). On the H200, in one
command from the repository root:

    .venv/bin/python -m pytest -q -p no:randomly tests/e2e/test_faults.py -k card -s

(each fault's stop message is printed with ``-s``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from atlas_lightning.errors import STOP_EXIT_CODES
from atlas_lightning.run.resume_state import check_resume_state
from atlas_lightning.store.checkpoints import latest_complete, verify_checkpoint
from atlas_lightning.store.records import read_record, read_step_tensors, verify_manifest
from tests.e2e.kill_harness import kill_once_written, run_to_end

NAME = "faults"
STEPS = 4
INJECT = "+callbacks.fault_injection._target_=atlas_lightning.callbacks.faults.FaultInjection"
#: (fault, step it strikes, what the stop names, exit cause, the launch's own overrides)
CHAIN = [("out_of_memory", 2, ["out of memory after RL step 1"], "out_of_memory", []),
         ("non_finite", 3, ["non-finite values: step 3: non-finite"], "non_finite", []),
         ("engine_kill", 4, ["the rollout engine failed after RL step 3"], "engine", [])]
#: The CPU's chain: the trainer SIGKILLed (its whole process group) once step 2's checkpoint is
#: complete (step 3 is then under way), before the NaN, which then strikes at step 4: the launch
#: after the kill trains step 3, whose records are compared with the uninterrupted run's
SIGKILL = ("sigkill", 3, [], None, [])
#: Then SIGTERM in step 3's rollout: the step finishes and is checkpointed (as Lightning stops on
#: SIGTERM), the stop names checkpoint 3 (``LAST``); the later launches resume from it.
SIGTERM = ("sigterm", 3, ["interrupted by SIGTERM after RL step 3"], "terminated", [])
CPU_CHAIN = [CHAIN[0], SIGKILL, SIGTERM, ("non_finite", 4, ["non-finite values: step 4: non-finite"], "non_finite", []),
             CHAIN[2]]
#: The faults whose stop names the step they strike at as the last one trained (not the one before)
LAST = {"sigterm"}
#: The disk full as step 4's checkpoint is written: the card's chain (on CPU a real fit on a full
#: disk ends in the same stop, ``tests/e2e/test_colocated_merged.py``, and the callback names the last
#: complete checkpoint, ``tests/callbacks/test_cb_checkpoint_background.py``: a launch less here)
WRITE = [("checkpoint_write", 4, ["a checkpoint could not be written after RL step 4", "No space left on device"],
          "write", [])]
#: The engine killed at a weight sync and in a validation: the card's chain (on CPU the same
#: wrapping of every engine call is tested call by call, ``tests/rollout/test_engine_failure.py``,
#: which keeps the suite's time; two launches here cost about a CPU-minute)
PHASES = [("engine_kill", 4, ["the rollout engine failed after RL step 3", "vllm engine failed during"], "engine",
           ["+callbacks.fault_injection.phase=sync"]),
          ("engine_kill", 4, ["the rollout engine failed after RL step 4", "failed during a generation step"],
           "engine", ["+callbacks.fault_injection.phase=validation", "trainer.val_every=4"])]

CPU = ["experiment=tiny-cpu", "rollout.n=2", "algorithm.train_batch_size=2", "algorithm.ppo_mini_batch_size=1",
       "rollout.max_tokens_per_turn=24"]
CARD = ["experiment=h200-tiny", "rollout.n=4", "algorithm.train_batch_size=4", "algorithm.ppo_mini_batch_size=2",
        "rollout.max_tokens_per_turn=32"]


def _command(setting: list[str], model: Path, data: Path, root: Path, *extra: str) -> list[str]:
    val_every = [] if any(arg.startswith("trainer.val_every=") for arg in extra) else ["trainer.val_every=100"]
    return [sys.executable, "-m", "atlas_lightning.cli", "fit", *setting, f"name={NAME}", f"model.path={model}",
            f"data.root={data}", f"paths.root={root}", f"trainer.total_steps={STEPS}", "trainer.save_every=1",
            "trainer.val_before_train=false", *val_every, "callbacks.validation.val_on_last_step=false",
            "logger.mode=disabled", *extra]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="2", WANDB_MODE="disabled")


def _fit(setting: list[str], model: Path, data: Path, root: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(_command(setting, model, data, root, *extra), capture_output=True, text=True, timeout=900,
                          env=_env())


def _killed(setting: list[str], model: Path, data: Path, root: Path, step: int) -> None:
    """A resumed launch SIGKILLed once step ``step - 1`` is checkpointed: nothing of step
    ``step`` looks complete, and a resume finds the checkpoint before it."""
    checkpoints = root / "checkpoints" / NAME
    marker = checkpoints / f"global_step_{step - 1}" / "checkpoint.json"
    kill_once_written(_command(setting, model, data, root, "trainer.resume=auto"), _env(), marker)
    print(f"\nSIGKILL once {marker.parent.name} was written")
    assert not (checkpoints / f"global_step_{step}" / "checkpoint.json").exists()
    assert not (root / "artifacts" / NAME / "train" / f"step_{step}").exists()
    # what a resume finds: the newest folder with its marker (the kill may fall before the
    # ``latest_checkpointed_iteration.txt`` pointer, written after the marker, moved on)
    assert latest_complete(checkpoints).name == marker.parent.name


def _chain(setting: list[str], model: Path, data: Path, root: Path, chain: list) -> None:
    checkpoints = root / "checkpoints" / NAME
    for index, (fault, step, named, cause, extra) in enumerate(chain):
        if fault == "sigkill":
            _killed(setting, model, data, root, step)
            continue
        resume = ["trainer.resume=auto"] if index else []
        inject = [INJECT, f"+callbacks.fault_injection.fault={fault}", f"+callbacks.fault_injection.step={step}"]
        done = _fit(setting, model, data, root, *resume, *inject, *extra)
        stop = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
        print(f"\n{fault} at step {step} {extra}: exit {done.returncode}: {stop}")
        assert done.returncode == STOP_EXIT_CODES[cause], done.stderr[-4000:]
        assert stop.startswith("atlas-lightning fit: stopped: ") and all(words in stop for words in named), stop
        assert "Traceback" not in done.stderr, done.stderr[-4000:]
        failed = step + 1 if fault in LAST else step
        last = checkpoints / f"global_step_{failed - 1}"
        assert str(last) in stop
        assert not (checkpoints / f"global_step_{failed}" / "checkpoint.json").exists()
        verify_checkpoint(last)  # intact: every file as its marker lists it
        check_resume_state(last)  # whole: optimizers, loops, cursor, generator states
        assert named[0] in (root / "outputs" / NAME / "main_ppo.log").read_text()
    done = _fit(setting, model, data, root, "trainer.resume=auto")
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"resuming from {checkpoints / 'global_step_3'}" in (root / "outputs" / NAME / "main_ppo.log").read_text()
    verify_checkpoint(checkpoints / f"global_step_{STEPS}")
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == str(STEPS)


def _records(root: Path, step: int) -> dict:
    folder = root / "artifacts" / NAME / "train" / f"step_{step}"
    assert verify_manifest(folder) == []
    return {p.name: read_record(p) for p in sorted(folder.glob("*.json")) if p.name != "manifest.json"}


def _assert_same_records(straight: Path, chained: Path) -> None:
    """The chain's step records are the uninterrupted run's: the same trajectories, rewards and
    endings; the same tokens; values, advantages and log-probs within float noise."""
    for step in range(1, STEPS + 1):
        expected, got = _records(straight, step), _records(chained, step)
        assert expected.keys() == got.keys(), step
        for name, record in expected.items():
            other = got[name]
            assert other.question_id == record.question_id and other.global_steps == step
            assert other.reward_score == pytest.approx(record.reward_score, abs=1e-9)
            assert other.episode["terminal_reason"] == record.episode["terminal_reason"]
        a, b = (read_step_tensors(root / "artifacts" / NAME / "train" / f"step_{step}" / "tensors.npz")
                for root in (straight, chained))
        for key in ("response_ids", "response_mask"):
            assert [x.tolist() for x in a[key]] == [x.tolist() for x in b[key]], (step, key)
        for key in ("values", "advantages", "response_logprobs"):
            for x, y in zip(a[key], b[key]):
                np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5, err_msg=f"step {step} {key}")


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.e2e
def test_cpu_faults_stop_cleanly_and_resume_to_the_uninterrupted_records(tiny_model_dir, sample_data_dir, tmp_path):
    straight, chained = tmp_path / "straight", tmp_path / "chain"
    run_to_end(_command(CPU, tiny_model_dir, sample_data_dir, straight), _env())
    _chain(CPU, tiny_model_dir, sample_data_dir, chained, CPU_CHAIN)
    _assert_same_records(straight, chained)
    marker = json.loads((chained / "checkpoints" / NAME / "global_step_3" / "checkpoint.json").read_text())
    assert marker["global_step"] == 3  # written by the launch after the SIGKILL


@pytest.mark.vllm
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the card's faults need a CUDA GPU")
def test_card_faults_stop_cleanly_and_resume(tiny_model_dir, sample_data_dir, tmp_path):
    _chain(CARD, tiny_model_dir, sample_data_dir, tmp_path, CHAIN + PHASES + WRITE)
