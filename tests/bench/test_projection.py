"""The projection of the training of record from a step benchmark: every phase carried over by its
stated rule (the inputs here are made up; the module's figures come from a real run)."""

from __future__ import annotations

import json

import pytest

from atlas_lightning.bench.projection import (A100_TFLOPS, REPORT_STEP_S, Measured, inputs_from_bench, main, markdown,
                                              project)

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


@pytest.mark.parametrize("content, message", [
    (None, "not a readable step_bench.json"),
    ("{not json", "not a readable step_bench.json"),
    ('{"steps": []}', "no measured step"),
    ('{"rows": []}', "not a step_bench.json of bench/step.py (no field 'steps')"),
    ('{"steps": [{"step": 2}]}', "not a step_bench.json of bench/step.py (no field 'phases_s')"),
    (json.dumps(BENCH), "no measured step 7 (it has steps [1])"),
], ids=["missing", "not_json", "no_steps", "other_json", "row_without_phases", "step_not_measured"])
def test_a_bench_file_that_cannot_serve_exits_2_with_one_line(tmp_path, capsys, content, message):
    """The file and what it lacks, exit 2, no traceback; a --step the report did not measure is
    refused, not replaced by its last step."""
    path = tmp_path / "step_bench.json"
    if content is not None:
        path.write_text(content)
    code = main(["--bench", str(path), "--step", "7"] if "it has steps" in message else ["--bench", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"python -m atlas_lightning.bench.projection: --bench {path}: ") and message in err


def test_the_measured_step_named_is_the_one_read():
    rows = [BENCH["steps"][0], {**BENCH["steps"][0], "step": 2, "trajectories": 8}]
    assert inputs_from_bench({**BENCH, "steps": rows}, step=1).rest_trajectories == 64
    assert inputs_from_bench({**BENCH, "steps": rows}).step == 2
