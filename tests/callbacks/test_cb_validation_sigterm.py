"""ValidationCallback under SIGTERM: a SIGTERM during the validation before the first step stops
the run once that validation is written, before step 1's rollout (Lightning alone would notice it
only at the end of step 1), with the stop of any SIGTERM (exit 143, ``run/interrupts.py``)."""

from __future__ import annotations

import json
import signal
import time

import pytest

from atlas_lightning.config import run_dirs
from atlas_lightning.errors import RunStopped
from atlas_lightning.run.faults import stops_cleanly


def test_sigterm_during_the_step_0_validation_stops_before_step_1(tmp_path, h, chat):
    cfg = h.make_cfg(tmp_path, total_steps=2)
    dirs = run_dirs(cfg)

    class SignalledDuringValidation(h.ScriptedDataModule):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.rollouts: list[int] = []

        def validation_rollout(self, step):
            signal.raise_signal(signal.SIGTERM)  # Lightning's handler notes it; nothing raises here
            deadline = time.monotonic() + 10.0
            while not self.trainer.received_sigterm and time.monotonic() < deadline:
                time.sleep(0.01)
            return super().validation_rollout(step)

        def rollout(self, step):
            self.rollouts.append(step)
            return super().rollout(step)

    module, datamodule = h.ScriptedModule(cfg), SignalledDuringValidation(cfg, chat)
    trainer = h.make_trainer([h.callback(cfg, "validation", val_every=1)])
    with pytest.raises(RunStopped) as stopped, stops_cleanly(dirs["checkpoints"], last_step=lambda: module.rl_step):
        trainer.fit(module, datamodule=datamodule)

    assert stopped.value.exit_code == 143
    assert str(stopped.value).startswith("interrupted by SIGTERM after RL step 0 (the last one finished)")
    assert datamodule.rollouts == [] and module.outputs == {}  # step 1 never began
    assert datamodule.val_calls == [0]
    rows = [json.loads(line) for line in (dirs["checkpoints"] / "global_step_0" / "val_dumps" / "0.jsonl")
            .read_text().splitlines()]
    assert len(rows) == len(h.VAL_QUESTIONS)  # the validation under way was written whole
    assert [step for step, metrics in module.logged if "gpqa/overall/acc" in metrics] == [0]
