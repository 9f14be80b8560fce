"""The step checkpoint written while the next step runs (``callbacks/checkpoint.py``,
``checkpoint_write.py``): what is written is the state at the saved step's end, the marker comes
only once the files are complete, one save at a time, a failed write stops the run at the next
step naming it, and a process SIGKILLed while a save is in flight resumes from the previous
complete checkpoint, with one process and with FSDP2 at two ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from atlas_lightning.callbacks.base import RLCallback
from atlas_lightning.callbacks.checkpoint import CheckpointWriteError
from atlas_lightning.config import run_dirs
from atlas_lightning.store.checkpoints import (LATEST, MARKER, is_complete, latest_complete, latest_verified,
                                               verify_checkpoint)

WORKER = Path(__file__).with_name("ckpt_kill_worker.py")
FORKED_RANKS = Path(__file__).resolve().parents[1] / "forked_ranks.py"


class _Watch(RLCallback):
    """At each step's end (before the checkpoint callback, which Lightning runs last): the critic
    weight, and whether each saved folder is complete yet; and every ``on_checkpoint_saved``."""

    def __init__(self, checkpoints: Path) -> None:
        self.checkpoints = checkpoints
        self.weights: dict[int, torch.Tensor] = {}
        self.complete_at_end: dict[int, list[int]] = {}
        self.heard: list[tuple[int, int]] = []
        self.step = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.step = batch.step
        self.weights[batch.step] = pl_module.critic.weight.detach().clone()
        self.complete_at_end[batch.step] = sorted(s for s in (2, 4) if is_complete(self.checkpoints / f"global_step_{s}"))

    def on_checkpoint_saved(self, trainer, step_dir, step) -> None:
        self.heard.append((step, self.step))


def _logged(module) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for step, metrics in module.logged:
        out.setdefault(step, {}).update(metrics)
    return out


def _fit(h, cfg, chat, callbacks, module=None):
    module = module or h.ScriptedModule(cfg)
    h.make_trainer(callbacks).fit(module, datamodule=h.ScriptedDataModule(cfg, chat))
    return module


def test_a_background_save_writes_the_saved_step_and_its_marker_last(tmp_path, h, chat):
    cfg = h.make_cfg(tmp_path, total_steps=5)
    checkpoints = run_dirs(cfg)["checkpoints"]
    watch = _Watch(checkpoints)
    module = h.slow_disk(h.ScriptedModule(cfg), from_step=1, seconds=1.0)
    _fit(h, cfg, chat, [watch, h.callback(cfg, "checkpoint", every_n_steps=2)], module)

    # step 3 ran (and changed the weights) while step 2 was written; step 2's files hold step 2's end
    assert not torch.equal(watch.weights[2], watch.weights[3])
    for step in (2, 4):
        folder = checkpoints / f"global_step_{step}"
        verify_checkpoint(folder)
        adapter = load_file(str(folder / "critic" / "lora_adapter" / "adapter_model.safetensors"))["weight"]
        state = torch.load(folder / "lightning" / "state.ckpt", weights_only=False)
        assert torch.equal(adapter, watch.weights[step]) and torch.equal(state["state_dict"]["critic.weight"], adapter)
        assert state["ScriptedDataModule"]["next_step"] == step + 1
    # not complete at the saved step's end (written meanwhile), complete by the next step's end,
    # and heard there
    assert watch.complete_at_end[2] == [] and watch.complete_at_end[4] == [2]
    assert watch.heard == [(2, 3), (4, 5), (5, 5)]
    assert latest_complete(checkpoints).name == "global_step_5" and (checkpoints / LATEST).read_text() == "5\n"
    assert not list(checkpoints.glob(".tmp-*"))
    logged = _logged(module)
    assert {"timing_s/checkpoint"} <= set(logged[2]) and logged[3]["timing_s/checkpoint_write"] >= 1.0
    assert logged[2]["timing_s/checkpoint"] < 1.0  # the step waited for the copies, not the slow disk


def test_blocking_saves_write_the_same_folders(tmp_path, h, chat):
    cfg = h.make_cfg(tmp_path, total_steps=4)
    checkpoints = run_dirs(cfg)["checkpoints"]
    watch = _Watch(checkpoints)
    module = _fit(h, cfg, chat, [watch, h.callback(cfg, "checkpoint", every_n_steps=2, background=False)])
    assert watch.heard == [(2, 2), (4, 4)]
    for step in (2, 4):
        assert sorted(verify_checkpoint(checkpoints / f"global_step_{step}")["files"]) == [
            "actor/lora_adapter/adapter_config.json", "actor/lora_adapter/adapter_model.safetensors",
            "critic/lora_adapter/adapter_config.json", "critic/lora_adapter/adapter_model.safetensors",
            "lightning/state.ckpt"]
    logged = _logged(module)
    assert logged[2]["timing_s/checkpoint"] >= logged[2]["timing_s/checkpoint_write"] > 0


class _FailingDisk(L.Callback):
    """From step ``step`` on, the module's checkpoint adapter writes fail (a full disk)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch.step != self.step:
            return

        def failing_snapshot(into=None):
            def write(step_dir) -> None:
                raise OSError(28, "No space left on device")
            return write

        pl_module.snapshot_adapters = failing_snapshot


def test_a_failed_background_write_stops_the_run_at_the_next_step(tmp_path, h, chat):
    cfg = h.make_cfg(tmp_path, total_steps=6)
    checkpoints = run_dirs(cfg)["checkpoints"]
    module = h.ScriptedModule(cfg)
    with pytest.raises(CheckpointWriteError) as caught:
        _fit(h, cfg, chat, [_FailingDisk(4), h.callback(cfg, "checkpoint", every_n_steps=2)], module)
    message = str(caught.value)
    assert "checkpoint of step 4 could not be written" in message and "No space left on device" in message
    assert f"{checkpoints / 'global_step_4'} has no {MARKER}" in message
    assert f"the last complete one is {checkpoints / 'global_step_2'}" in message
    assert sorted(module.outputs) == [1, 2, 3, 4, 5]  # raised at step 5's end, before step 6
    assert latest_verified(checkpoints)[0].name == "global_step_2"
    assert not (checkpoints / "global_step_4" / MARKER).exists()


def _run(args: list, root: Path, world: int = 1) -> subprocess.CompletedProcess:
    launcher = [sys.executable, str(FORKED_RANKS), str(world)] if world > 1 else [sys.executable]
    return subprocess.run([*launcher, str(WORKER), str(root), *args], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))


def _kill_while_writing(args: list, root: Path, world: int, step: int) -> None:
    launcher = [sys.executable, str(FORKED_RANKS), str(world)] if world > 1 else [sys.executable]
    process = subprocess.Popen([*launcher, str(WORKER), str(root), *args], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, env=dict(os.environ, OMP_NUM_THREADS="1",
                                                                PYTHONWARNINGS="ignore"), start_new_session=True)
    signal_file, deadline = root / f"writing_{step}", time.monotonic() + 300
    while not signal_file.exists():
        assert process.poll() is None, process.stderr.read()[-4000:]
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(1.0)  # the next step is under way, the save still in flight
    assert process.poll() is None
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@pytest.mark.multiprocess
@pytest.mark.slow
# one process in make test (28 s), two FSDP2 ranks in make test-e2e (76 s): CI's 15 minutes
@pytest.mark.parametrize("mode,world", [("single", 1), pytest.param("fsdp", 2, marks=pytest.mark.e2e)])
def test_sigkill_while_a_save_is_in_flight_resumes_from_the_previous_checkpoint(tmp_path, mode, world):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    done = _run([mode, "0"], straight, world)
    assert done.returncode == 0, done.stderr[-4000:]

    _kill_while_writing([mode, "4"], crashed, world, step=4)
    checkpoints = crashed / "checkpoints" / mode
    assert not is_complete(checkpoints / "global_step_4")  # step 4's save was cut short: no marker
    assert latest_verified(checkpoints) == (checkpoints / "global_step_2", [])
    assert (checkpoints / LATEST).read_text() == "2\n"

    done = _run([mode, "0", "resume"], crashed, world)
    assert done.returncode == 0, done.stderr[-4000:]
    expected, got = (json.loads((root / f"{mode}-result.json").read_text()) for root in (straight, crashed))
    assert expected["trained"] == [1, 2, 3, 4, 5, 6]
    assert got["resumed_from"] == "global_step_2" and got["trained"] == [3, 4, 5, 6]
    assert torch.allclose(torch.tensor(got["weight"]), torch.tensor(expected["weight"]), atol=1e-6)
    for step in (2, 4, 6):
        verify_checkpoint(checkpoints / f"global_step_{step}")
