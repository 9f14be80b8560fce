"""ValidationCallback with ``overlap``: a periodic validation rides with the next step's training
rollout (the harness's datamodule samples it there) and is logged, dumped and recorded at its own
step exactly as a validation alone is; step 0 and the last step run alone; training's random
draws stay where they were; a pending validation lives in the checkpoint, and a run killed after
that checkpoint and before the ride resumes it."""

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

from atlas_lightning.config import run_dirs

WORKER = Path(__file__).with_name("val_kill_worker.py")


def _val_logs(module):
    return {step: metrics for step, metrics in module.logged if "gpqa/overall/acc" in metrics}


def _files(folder: Path) -> dict[str, str]:
    """Every validation file of a run (dumps, records, manifests), write times taken out."""
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and ("val_dumps" in path.parts or "val" in path.parts):
            text = path.read_text(errors="replace") if path.suffix in (".json", ".jsonl") else path.read_bytes().hex()
            if path.suffix == ".json":
                data = json.loads(text)
                for key in ("written_at", "created_at", "files"):
                    data.pop(key, None)
                text = json.dumps(data, sort_keys=True)
            out[path.relative_to(folder).as_posix()] = text
    return out


def _fit(tmp_path, h, chat, overlap: bool, total_steps: int = 5):
    cfg = h.make_cfg(tmp_path / ("on" if overlap else "off"), total_steps=total_steps)
    L.seed_everything(123, verbose=False)
    callback = h.callback(cfg, "validation", val_every=2, overlap=overlap)

    class LoggingModule(h.ScriptedModule):
        """Logs its step's metrics, as ``PPOModule.training_step`` does."""

        def training_step(self, batch, batch_idx):
            output = super().training_step(batch, batch_idx)
            self.log_metrics({"critic/vf_loss": output["metrics"]["critic/vf_loss"]}, step=batch.step)
            return output

    module, dm = LoggingModule(cfg), h.ScriptedDataModule(cfg, chat)
    h.make_trainer([callback]).fit(module, datamodule=dm)
    return cfg, module, dm, callback


def test_overlapped_validation_logs_and_writes_what_validation_alone_does(tmp_path, h, chat):
    runs = {overlap: _fit(tmp_path, h, chat, overlap) for overlap in (False, True)}
    (cfg_off, off, dm_off, _), (cfg_on, on, dm_on, callback) = runs[False], runs[True]
    assert dm_off.val_calls == dm_on.val_calls == [0, 2, 4, 5]
    assert callback.validated == [0, 2, 4, 5] and callback.pending is None

    logs_off, logs_on = _val_logs(off), _val_logs(on)
    assert sorted(logs_on) == sorted(logs_off) == [0, 2, 4, 5]
    for step in (0, 2, 4, 5):
        same = {k: v for k, v in logs_on[step].items() if not k.startswith("timing_s/")}
        assert same == {k: v for k, v in logs_off[step].items() if not k.startswith("timing_s/")}
        assert logs_on[step]["timing_s/testing"] > 0
    # steps 2 and 4 rode with the next rollout; 0 (before training) and 5 (the last) ran alone
    assert [s for s in logs_on if "timing_s/testing_overlapped" in logs_on[s]] == [2, 4]
    assert not any("timing_s/testing_overlapped" in m for m in logs_off.values())
    # the validation of step 2 is logged at step 2, before anything of step 3
    order = [(step, "gpqa/overall/acc" in metrics) for step, metrics in on.logged]
    assert order.index((2, True)) < order.index((3, False)) and order.index((4, True)) < order.index((5, False))
    assert [step for step, _ in on.logged] == sorted(step for step, _ in on.logged)

    assert on.draws == off.draws  # training draws what it draws without validation riding
    for key in ("artifacts", "checkpoints"):
        assert _files(run_dirs(cfg_on)[key]) == _files(run_dirs(cfg_off)[key])


def test_the_pending_validation_is_in_the_state_and_resumes(tmp_path, h, chat):
    cfg = h.make_cfg(tmp_path, total_steps=4)
    callback = h.callback(cfg, "validation", val_every=2, overlap=True)
    assert callback.state_dict() == {"validated": []}
    callback.load_state_dict({"validated": [0], "pending": 2})
    dm = h.ScriptedDataModule(cfg, chat)
    dm.next_step = 3
    trainer = h.make_trainer([callback])
    module = h.ScriptedModule(cfg)
    trainer.fit(module, datamodule=dm)
    assert dm.val_calls == [2, 4] and callback.validated == [0, 2, 4]
    assert sorted(_val_logs(module)) == [2, 4]


def test_a_pending_validation_resumed_with_overlap_off_is_validated_all_the_same(tmp_path, h, chat):
    """A checkpoint that deferred step 2's validation, resumed with ``overlap`` off: step 2 is
    still validated and logged at step 2 (never lost), later steps validate alone."""
    cfg = h.make_cfg(tmp_path, total_steps=4)
    callback = h.callback(cfg, "validation", val_every=2, overlap=False)
    callback.load_state_dict({"validated": [0], "pending": 2})
    dm = h.ScriptedDataModule(cfg, chat)
    dm.next_step = 3
    module = h.ScriptedModule(cfg)
    h.make_trainer([callback]).fit(module, datamodule=dm)
    assert dm.val_calls == [2, 4] and callback.validated == [0, 2, 4] and callback.pending is None
    assert sorted(_val_logs(module)) == [2, 4]


def test_a_stop_before_the_ride_validates_alone(tmp_path, h, chat):
    cfg = h.make_cfg(tmp_path, total_steps=4)
    callback = h.callback(cfg, "validation", val_every=2, overlap=True, val_before_train=False)

    class StopAfterTwo(L.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            trainer.should_stop = trainer.should_stop or args[2].step == 2

    _, module, dm = h.fit(cfg, chat, [callback, StopAfterTwo()])
    assert dm.val_calls == [2] and dm.rider is None and sorted(_val_logs(module)) == [2]
    assert "timing_s/testing_overlapped" not in _val_logs(module)[2]


def test_a_datamodule_that_cannot_carry_it_validates_alone(tmp_path, h, chat):
    cfg = h.make_cfg(tmp_path, total_steps=3)
    callback = h.callback(cfg, "validation", val_every=1, overlap=True, val_before_train=False)
    dm = h.ScriptedDataModule(cfg, chat)
    dm.carries_validation = False  # the separate layout's
    module = h.ScriptedModule(cfg)
    h.make_trainer([callback]).fit(module, datamodule=dm)
    assert dm.val_calls == [1, 2, 3] and not dm.ridden
    assert not any("timing_s/testing_overlapped" in m for m in _val_logs(module).values())


# -- SIGKILL between the checkpoint of step N and the ride of its validation -------------------------

def _worker(root: Path, *args: str) -> list:
    return [sys.executable, str(WORKER), str(root), *args]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


@pytest.mark.slow
@pytest.mark.e2e  # a launch killed and resumed (~60 s on two cores): make test-e2e
def test_sigkill_before_the_ride_resumes_the_pending_validation(tmp_path):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    done = subprocess.run(_worker(straight), capture_output=True, text=True, timeout=600, env=_env())
    assert done.returncode == 0, done.stderr[-4000:]

    # killed in step 3's rollout: the checkpoint of step 2 is complete, step 2's validation pending
    process = subprocess.Popen(_worker(crashed, "hold"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env=_env(), start_new_session=True)
    deadline = time.monotonic() + 300
    while not (crashed / "holding").exists():
        assert process.poll() is None, process.stderr.read()[-4000:]
        assert time.monotonic() < deadline
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    checkpoints = crashed / "checkpoints" / "valkill"
    assert not (checkpoints / "global_step_2" / "val_dumps").exists()  # the ride never came

    done = subprocess.run(_worker(crashed, "resume"), capture_output=True, text=True, timeout=600, env=_env())
    assert done.returncode == 0, done.stderr[-4000:]
    expected, got = (json.loads((root / "result.json").read_text()) for root in (straight, crashed))
    assert got["resumed_from"] == "global_step_2" and got["trained"] == [3, 4]
    assert expected["val_calls"] == [0, 2, 4] and got["val_calls"] == [2, 4]
    assert got["validation"]["2"] == expected["validation"]["2"]
    assert got["validation"]["4"] == expected["validation"]["4"]
    for step in (2, 4):
        dump = f"global_step_{step}/val_dumps/{step}.jsonl"
        assert (checkpoints / dump).read_text() == (straight / "checkpoints" / "valkill" / dump).read_text()
