"""The projection of the training of record from a step benchmark: every phase carried over by its
stated rule (the inputs here are made up; the module's figures come from a real run)."""

from __future__ import annotations

import pytest

from atlas_lightning.bench.projection import A100_TFLOPS, REPORT_STEP_S, Measured, inputs_from_bench, markdown, project

BENCH = {"peak_bf16_tflops": 780.0, "plain_generate": {"tokens_per_s": 3000.0, "gen_vs_plain": 0.9},
         "steps": [{"step": 1, "trajectories": 64, "other_s": 1.0,
                    "phases_s": {"gen": 25.0, "sleep": 17.0, "wake": 0.6, "update_weights": 2.0, "assemble": 0.5,
                                 "adv": 0.1},
                    "callbacks_s": {"WeightSyncCallback": 3.0, "ArtifactDumpCallback": 1.0, "StepCheckpoint": 5.0},
                    "useful_mfu": {"old_log_prob": 0.5, "values": 0.5, "update_critic": 0.4, "update_actor": 0.4}}]}


def test_the_projection_carries_each_phase_by_its_rule():
    measured = inputs_from_bench(BENCH)
    assert measured.update_mfu == 0.4 and measured.loop_efficiency == 0.9 and measured.sleep_s == pytest.approx(17.6)
    result = project(measured)
    h200, a100 = result["phases_h200_s"], result["phases_a100_s"]
    assert result["total_h200_s"] == pytest.approx(sum(h200.values()))
    assert result["report_a100_s"] == REPORT_STEP_S
    # compute phases scale by the matmul rate; the update is 2 epochs of forward + backward
    assert a100["update_actor"] == pytest.approx(h200["update_actor"] * 780.0 / A100_TFLOPS)
    assert h200["update_actor"] > 2 * h200["old_log_prob"]
    # halving the update's MFU doubles its seconds and nothing else
    slower = project(Measured(**{**vars(measured), "update_mfu": 0.2}))["phases_h200_s"]
    assert slower["update_critic"] == pytest.approx(2 * h200["update_critic"])
    assert slower["gen"] == pytest.approx(h200["gen"])
    # a slower agent loop costs generation time in proportion
    half = Measured(**{**vars(measured), "loop_efficiency": 0.45})
    assert project(half)["inputs"]["decode_s"] == pytest.approx(2 * result["inputs"]["decode_s"])
    text = markdown(result)
    assert "**step**" in text and "assumptions:" in text


def test_every_checkpoint_callback_is_the_checkpoint_not_the_rest():
    """A run that also pushes checkpoints to the Hub: both callbacks' seconds are the checkpoint
    (as ``bench/step.py`` counts them), none of them ``rest_s``."""
    row = {**BENCH["steps"][0], "callbacks_s": {**BENCH["steps"][0]["callbacks_s"], "HubCheckpointCallback": 2.5}}
    with_hub = inputs_from_bench({**BENCH, "steps": [row]})
    without = inputs_from_bench(BENCH)
    assert with_hub.checkpoint_s == pytest.approx(5.0 + 2.5) and without.checkpoint_s == pytest.approx(5.0)
    assert with_hub.rest_s == pytest.approx(without.rest_s) == pytest.approx(1.0 + 0.5 + 0.1 + 1.0)
