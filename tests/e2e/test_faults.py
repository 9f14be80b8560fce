"""Faults part-way through a fit, through the CLI: the engine killed in the middle of a rollout,
at a weight sync and in the middle of a validation, out of memory in the middle of an update, a
NaN during an update, the disk full while a checkpoint is written. Each ends in a clean stop
that names its cause (exit 4, 5, 6, 7; no traceback; ``run/faults.py``), leaves the last complete
checkpoint intact (it verifies against its ``checkpoint.json`` and its state is whole) and the
next launch resumes from it. The faults are injected by ``callbacks/faults.py`` (``FaultInjection``).

One chain per machine, each launch resuming the last: out of memory at step 2 (checkpoint 1
left), a NaN at step 3 (checkpoint 2), then launches that each fail step 4 from checkpoint 3:
the engine killed in its rollout, and on the card also at its weight sync (the probe meets the
dead engine), in its validation (the launch validates at step 4) and with the disk full as its
checkpoint is written (found at fit's end: the marker never written); then a clean resume to the
end (checkpoint 4).
The CPU chain runs in the normal suite (tiny model, vLLM's CPU engine, a real allocation failure is impossible there: ``torch.OutOfMemoryError`` is raised at
the injection point). The card chain runs the same on a GPU (``experiment=h200-tiny``: FSDP2 at
world 1, the in-process vLLM engine asleep during updates, a bf16 base: the NaN comes in a bf16
update; the out-of-memory is a real CUDA allocation larger than the card). On the H200, in one
command from the repository root:

    .venv/bin/python -m pytest -q -p no:randomly tests/e2e/test_faults.py -k card -s

(each fault's stop message is printed with ``-s``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from atlas_lightning.errors import STOP_EXIT_CODES
from atlas_lightning.run.resume_state import check_resume_state
from atlas_lightning.store.checkpoints import verify_checkpoint

NAME = "faults"
STEPS = 4
INJECT = "+callbacks.fault_injection._target_=atlas_lightning.callbacks.faults.FaultInjection"
#: (fault, step it strikes, what the stop names, exit cause, the launch's own overrides)
CHAIN = [("out_of_memory", 2, ["out of memory after RL step 1"], "out_of_memory", []),
         ("non_finite", 3, ["non-finite values: step 3: non-finite"], "non_finite", []),
         ("engine_kill", 4, ["the rollout engine failed after RL step 3"], "engine", [])]
#: The disk full as step 4's checkpoint is written: the card's chain (on CPU a real fit on a full
#: disk ends in the same stop, ``tests/run/test_run_log.py``, and the callback names the last
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


def _fit(setting: list[str], model: Path, data: Path, root: Path, *extra: str) -> subprocess.CompletedProcess:
    val_every = [] if any(arg.startswith("trainer.val_every=") for arg in extra) else ["trainer.val_every=100"]
    command = [sys.executable, "-m", "atlas_lightning.cli", "fit", *setting, f"name={NAME}", f"model.path={model}",
               f"data.root={data}", f"paths.root={root}", f"trainer.total_steps={STEPS}", "trainer.save_every=1",
               "trainer.val_before_train=false", *val_every, "callbacks.validation.val_on_last_step=false",
               "logger.mode=disabled", *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, OMP_NUM_THREADS="2", WANDB_MODE="disabled"))


def _chain(setting: list[str], model: Path, data: Path, root: Path, chain: list) -> None:
    checkpoints = root / "checkpoints" / NAME
    for index, (fault, step, named, cause, extra) in enumerate(chain):
        resume = ["trainer.resume=auto"] if index else []
        done = _fit(setting, model, data, root, *resume, INJECT, f"+callbacks.fault_injection.fault={fault}",
                    f"+callbacks.fault_injection.step={step}", *extra)
        stop = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
        print(f"\n{fault} at step {step} {extra}: exit {done.returncode}: {stop}")
        assert done.returncode == STOP_EXIT_CODES[cause], done.stderr[-4000:]
        assert stop.startswith("atlas-lightning fit: stopped: ") and all(words in stop for words in named), stop
        assert "Traceback" not in done.stderr, done.stderr[-4000:]
        last = checkpoints / f"global_step_{step - 1}"
        assert str(last) in stop
        assert not (checkpoints / f"global_step_{step}" / "checkpoint.json").exists()
        verify_checkpoint(last)  # intact: every file as its marker lists it
        check_resume_state(last)  # whole: optimizers, loops, cursor, generator states
        assert named[0] in (root / "outputs" / NAME / "main_ppo.log").read_text()
    done = _fit(setting, model, data, root, "trainer.resume=auto")
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"resuming from {checkpoints / 'global_step_3'}" in (root / "outputs" / NAME / "main_ppo.log").read_text()
    verify_checkpoint(checkpoints / f"global_step_{STEPS}")
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == str(STEPS)


@pytest.mark.vllm
@pytest.mark.slow
def test_cpu_faults_stop_cleanly_and_resume(tiny_model_dir, sample_data_dir, tmp_path):
    _chain(CPU, tiny_model_dir, sample_data_dir, tmp_path, CHAIN)


@pytest.mark.vllm
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the card's faults need a CUDA GPU")
def test_card_faults_stop_cleanly_and_resume(tiny_model_dir, sample_data_dir, tmp_path):
    _chain(CARD, tiny_model_dir, sample_data_dir, tmp_path, CHAIN + PHASES + WRITE)
