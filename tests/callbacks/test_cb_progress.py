"""The progress bar in RL steps: one line a step (console and the run's log), the validation
objective, and the rollout phase from the datamodule (``callbacks/progress.py``)."""

from __future__ import annotations

import logging

from atlas_lightning.callbacks.progress import RLProgressBar, step_line, validation_objective


def test_the_step_line_says_step_reward_time_and_validation():
    metrics = {"critic/score/mean": 0.4123, "reward/acc": 0.5, "reward/objective": 0.4981,
               "reward/num_explores": 2.1, "timing_s/step": 107.24, "timing_s/gen": 10.8, "timing_s/update_actor": 40.0}
    line = step_line(3, 40, metrics, (0, 0.52))
    assert line == ("step 3/40 | reward 0.412 | acc 0.500 | objective 0.498 | explores 2.100 | "
                    "107.2 s (gen 10.8, update 40.0) | val objective 0.520 (step 0)")
    assert step_line(3, None, {}, None, finite=False) == "step 3 | NON-FINITE: update skipped (see the NaN guard)"
    assert validation_objective({"gpqa/overall/objective": 0.5, "lcb/overall/objective": 0.3,
                                 "gpqa/diamond/objective": 9.0}) == 0.4


def test_a_fit_prints_and_logs_one_line_a_step_with_the_validation_objective(tmp_path, h, chat, caplog, capsys):
    cfg = h.make_cfg(tmp_path, total_steps=3)
    bar = RLProgressBar(total_steps=3)
    with caplog.at_level(logging.INFO, logger="atlas_lightning.progress"):
        h.fit(cfg, chat, [h.callback(cfg, "validation", val_every=2), bar], enable_progress_bar=True)
    lines = [r.getMessage() for r in caplog.records if r.name == "atlas_lightning.progress"]
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in steps] == ["step 1/3", "step 2/3", "step 3/3"]
    assert "val objective" in steps[-1] and any(line.startswith("validation step 2 | objective") for line in lines)
    printed = "".join(capsys.readouterr())
    assert all(line in printed for line in steps)  # above the bar, on the console
