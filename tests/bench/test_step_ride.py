"""The step benchmark's report (``bench.step.build_report``, ``markdown``) of a validation that
rode with the next step's training rollout (``callbacks.validation.overlap``): logged under its own
step N at step N+1's batch start, with ``timing_s/testing`` its marginal seconds and
``timing_s/testing_overlapped`` its seconds under N+1's training trajectories. Step N's row says
what it cost (its deferral, its tail in step N+1's generation, its recording at step N+1's batch
start) and amortises that; step N+1 counts those seconds as validation, not as generation or the
rest. A synthetic history, built by hand, so that every figure is checked against arithmetic."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest

from atlas_lightning.bench.step import StepBenchCallback, build_report
from atlas_lightning.bench.step_markdown import markdown
from atlas_lightning.config import compose

# step 1's validation rides with step 2's rollout; step 2 (the last) validates alone
TAIL, GATHER, OVERLAPPED = 1.0, 0.05, 3.0  # the ride: seconds after, gathering, under the training trajectories
DEFERRAL, RECORDING, ALONE = 0.01, 0.5, 9.5  # ValidationCallback: step 1's batch end, step 2's start and end


def _ride_report():
    cfg = compose(["experiment=tiny-cpu", "trainer.total_steps=2", "trainer.val_every=1", "trainer.save_every=0"])
    history = {1: {"timing_s/gen": 13.0, "timing_s/update_actor": 10.0,
                   # logged at step 2's batch start, under step 1, into the same row
                   "timing_s/testing": TAIL + GATHER, "timing_s/testing_overlapped": OVERLAPPED},
               2: {"timing_s/gen": 16.0, "timing_s/update_actor": 10.0, "timing_s/testing": 9.0}}
    return cfg, build_report(
        cfg, history, rollout_start={1: 0.0, 2: 30.0}, ended=70.0,
        callback_s={1: {"ValidationCallback": DEFERRAL}, 2: {"ValidationCallback": RECORDING + ALONE}},
        callback_start_s={2: {"ValidationCallback": RECORDING}},
        ride_tail_s={1: TAIL},  # step 1's validation ran on 1 s after step 2's training trajectories
        lengths={1: [1000, 3000], 2: [1000, 3000]}, generated={1: 1300, 2: 1500}, replayed={})


def test_the_ridden_validation_is_costed_at_its_step_and_not_again_in_the_next():
    cfg, report = _ride_report()
    one, two = report["steps"]
    ride = one["validation"]
    assert ride["rides"] and ride["testing_s"] == pytest.approx(TAIL + GATHER)
    assert ride["overlapped_s"] == pytest.approx(OVERLAPPED)
    # its cost: the deferral, its tail in step 2's gen, its recording at step 2's batch start
    assert ride["cost_s"] == pytest.approx(DEFERRAL + TAIL + RECORDING)
    assert ride["in_step_s"] == pytest.approx(DEFERRAL)
    assert two["validation"]["rider_tail_s"] == pytest.approx(TAIL)
    assert two["validation"]["rider_recorded_s"] == pytest.approx(RECORDING)
    assert two["validation"]["in_step_s"] == pytest.approx(TAIL + RECORDING + ALONE)
    assert two["validation"]["cost_s"] == pytest.approx(ALONE)
    # every validation second of the run is in one step's wall and costed once
    assert sum(r["validation"]["cost_s"] for r in report["steps"]) == pytest.approx(
        sum(r["validation"]["in_step_s"] for r in report["steps"]))

    # step 1 amortises its ride's cost (val_every 1: all of it); step 2's steady figure is without it
    gpus = int(cfg.layout.gpus)
    assert one["tokens_per_s_per_gpu"]["amortised"] == pytest.approx(
        4000 / ((30.0 - DEFERRAL + DEFERRAL + TAIL + RECORDING) * gpus))
    steady = 40.0 - (TAIL + RECORDING + ALONE)
    assert two["tokens_per_s_per_gpu"]["without_periodic"] == pytest.approx(4000 / (steady * gpus))
    assert two["tokens_per_s_per_gpu"]["amortised"] == pytest.approx(4000 / ((steady + ALONE) * gpus))
    # step 2's generation is its training trajectories'; the tail after them is validation
    assert two["shares"]["generation"] == pytest.approx((16.0 - TAIL) / 40.0)
    assert two["shares"]["validation"] == pytest.approx((TAIL + RECORDING + ALONE) / 40.0)
    assert two["gen_tokens_per_s"] == pytest.approx(1500 / (16.0 - TAIL))


def test_a_report_without_where_the_ride_ran_amortises_its_logged_marginal_seconds():
    """Without the ride's tail (measured as the datamodule hands the ridden batch over) it cannot
    be told from the next step's generation: its step still shows what it logged and amortises the
    marginal seconds."""
    cfg = compose(["experiment=tiny-cpu", "trainer.total_steps=2", "trainer.val_every=1", "trainer.save_every=0"])
    history = {1: {"timing_s/gen": 13.0, "timing_s/testing": TAIL + GATHER, "timing_s/testing_overlapped": OVERLAPPED},
               2: {"timing_s/gen": 16.0}}
    report = build_report(cfg, history, rollout_start={1: 0.0, 2: 30.0}, ended=70.0,
                          callback_s={1: {"ValidationCallback": DEFERRAL}}, lengths={1: [4000], 2: [4000]},
                          generated={1: 1300, 2: 1500}, replayed={})
    one = report["steps"][0]
    assert one["validation"]["overlapped_s"] == pytest.approx(OVERLAPPED)
    assert one["validation"]["cost_s"] == pytest.approx(DEFERRAL + TAIL + GATHER)
    assert one["tokens_per_s_per_gpu"]["amortised"] == pytest.approx(
        4000 / ((30.0 + TAIL + GATHER) * int(cfg.layout.gpus)))
    assert "validation riding with step 2's rollout, overlapped" in markdown(report)


def test_the_markdown_says_where_the_ridden_seconds_are():
    _, report = _ride_report()
    text = markdown(report)
    step_one, step_two = text.split("## RL step 2")
    assert "validation riding with step 2's rollout" in step_one
    assert f"| {OVERLAPPED:.2f} |" in step_one and f"| {TAIL + GATHER:.2f} |" in step_one
    assert f"step 1's validation riding: its last {TAIL:.2f} s" in step_two
    assert f"the last {TAIL:.2f} s of gen and {RECORDING:.2f} s of callback ValidationCallback" in step_two
    assert f"training trajectories' {16.0 - TAIL:.2f} s" in step_two


def test_the_callback_times_batch_start_hooks_and_reads_the_ridden_batchs_tail():
    """A deferred validation is recorded in the next step's ``on_train_batch_start``: timed, and
    filed under that step; its tail is read from the ridden batch the datamodule hands over."""
    class Recording(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            pass

    recording = Recording()
    ridden = {1: SimpleNamespace(timing={"gen": 4.0, "tail": 1.25, "overlapped": 2.75})}
    datamodule = SimpleNamespace(engine=object(), rollout=lambda step: None,
                                 take_validation=lambda step: ridden.pop(step, None))
    trainer = SimpleNamespace(datamodule=datamodule, callbacks=[recording])
    bench = StepBenchCallback(out="unused", replay=False)
    bench.setup(trainer, None, "fit")
    batch = SimpleNamespace(step=2)
    recording.on_train_batch_start(trainer, None, batch, 0)
    assert set(bench.callback_start_s[2]) == {"Recording"}
    assert bench.callback_s[2]["Recording"] == pytest.approx(bench.callback_start_s[2]["Recording"])
    assert datamodule.take_validation(1).timing["tail"] == 1.25 and datamodule.take_validation(3) is None
    assert bench.ride_tail_s == {1: 1.25}
