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


# -- a step of the truncated hybrid, on another card ------------------------------------------------

#: a made-up step of the Qwen3.6-27B shape's first 4 layers on an H100, the engine eager
HYBRID_LAYERS, HYBRID_SEQ, HYBRID_SCORED, HYBRID_PEAK = 4, [1100] * 64, 512 * 64, 776.0


def _meta_model(layers=None):
    """The 27B shape (its first ``layers``) built here on the meta device, apart from the projection's own build."""
    import torch

    from atlas_lightning.bench.shapes import build_model, shape_by_name

    return build_model(shape_by_name("qwen3_6_27b"), device=torch.device("meta"), dtype=torch.bfloat16,
                       attn_implementation="sdpa", layers=layers)


def _meta_flops(layers=None):
    """The shape's useful FLOPs (``bench/flops.py``)."""
    from atlas_lightning.bench.flops import model_flops

    return model_flops(_meta_model(layers), 64)


def _hybrid_report(update_s: float = 10.0) -> dict:
    flops = _meta_flops(HYBRID_LAYERS)
    work = {"update_critic": 2 * flops.train_step("critic", HYBRID_SEQ, HYBRID_SCORED),
            "update_actor": 2 * flops.train_step("actor", HYBRID_SEQ, HYBRID_SCORED),
            "old_log_prob": flops.forward("actor", HYBRID_SEQ, HYBRID_SCORED),
            "values": flops.forward("critic", HYBRID_SEQ, HYBRID_SCORED)}
    # the critic's update at the actor's MFU (the projection carries the two updates' mean)
    seconds = {"update_critic": update_s * work["update_critic"] / work["update_actor"], "update_actor": update_s,
               "old_log_prob": 2.0, "values": 2.0}
    row = {"step": 2, "trajectories": 64, "other_s": 0.4, "generated_tokens": 32768,
           "phases_s": {"gen": 20.0, "sleep": 0.5, "wake": 0.5, "update_weights": 2.0, **seconds},
           "callbacks_s": {"StepCheckpoint": 4.0},
           "useful_mfu": {p: work[p] / seconds[p] / (HYBRID_PEAK * 1e12) for p in work}}
    return {"build": {"shape": "qwen3_6_27b", "layers": HYBRID_LAYERS}, "peak_bf16_tflops": HYBRID_PEAK,
            "environment": {"gpu": "NVIDIA H100 80GB HBM3", "card_hbm_tbs": 3.35},
            "engine": {"enforce_eager": True, "max_in_flight": 256},
            "plain_generate": {"done": True, "step": 2, "tokens_per_s": 1000.0, "requests": 64},
            "steps": [row]}


def test_a_truncated_hybrid_step_scales_the_update_by_the_full_shapes_flops_at_its_mfu():
    """The update of the record = the measured seconds x (the full shape's FLOPs of a card's work /
    the truncated shape's FLOPs of the measured work) x (measured rate / target rate): computed
    here from the two shapes' FLOPs, not from the projection's figures."""
    from atlas_lightning.bench.cards import H200_MEASURED_TFLOPS
    from atlas_lightning.bench.projection import MIX_GENERATED, MIX_TOKENS, TP_EFFICIENCY

    measured = inputs_from_bench(_hybrid_report())
    assert (measured.measured_shape, measured.measured_layers, measured.card_hbm_tbs) == ("qwen3_6_27b", 4, 3.35)
    assert measured.decode_scaling == "layers" and measured.loop_efficiency == pytest.approx(32768 / 20.0 / 1000.0)
    result = project(measured)
    truncated, full = _meta_flops(HYBRID_LAYERS), _meta_flops()
    record_work = 2 * full.train_step("actor", [int(MIX_TOKENS)], int(MIX_TOKENS - 1536)) * 1024 / 8
    measured_work = 2 * truncated.train_step("actor", HYBRID_SEQ, HYBRID_SCORED)
    ratio = record_work / measured_work
    assert ratio > 10  # 16 times the layers, 13 times the tokens: not a near-identity
    assert result["phases_h200_s"]["update_actor"] == pytest.approx(10.0 * ratio * HYBRID_PEAK / H200_MEASURED_TFLOPS)
    assert result["phases_a100_s"]["update_actor"] == pytest.approx(10.0 * ratio * HYBRID_PEAK / A100_TFLOPS)
    # twice the measured seconds at the same work: half the MFU, twice the projected update
    slower = project(inputs_from_bench(_hybrid_report(update_s=20.0)))
    assert slower["phases_h200_s"]["update_critic"] == pytest.approx(2 * result["phases_h200_s"]["update_critic"])
    # an eager engine: the decode rate scales by layers (4 of 64), the same on every card
    engine = 1000.0 * measured.loop_efficiency * 4 / 64 * TP_EFFICIENCY
    assert result["inputs"]["decode_s"] == pytest.approx(1024 * MIX_GENERATED / 2 / engine)
    assert result["inputs"]["targets"]["a100"]["decode_s"] == pytest.approx(result["inputs"]["decode_s"])
    # the sync and the checkpoint by adapter size, full over truncated
    assert result["phases_h200_s"]["update_weights"] == pytest.approx(2.0 * full.lora_params / truncated.lora_params)
    text = markdown(result)
    assert "qwen3_6_27b, 4 decoder layers, on NVIDIA H100 80GB HBM3" in text and "decode (layers)" in text


def test_an_older_report_takes_its_build_from_the_options(tmp_path, capsys):
    """A report written before step.py recorded its build: the options name it, and the
    projection says nothing is assumed about it."""
    report = _hybrid_report()
    del report["build"]
    path = tmp_path / "step_bench.json"
    path.write_text(json.dumps(report))
    out = tmp_path / "projection.json"
    code = main(["--bench", str(path), "--measured-shape", "qwen3_6_27b", "--measured-layers", "4", "--json", str(out)])
    assert code == 0
    written = json.loads(out.read_text())
    assert written["inputs"]["layers_measured"] == 4 and written["inputs"]["assumed"] == []
    assert "assumed" not in written["assumptions"][0]


@pytest.mark.parametrize("change, argv, message", [
    (lambda r: r.pop("build"), [], "names no model build (bench/step.py --build) and ran on NVIDIA H100 80GB HBM3"
                                   ", not the H200 of the 8B-shaped steps: give --measured-shape and --measured-layers"),
    (lambda r: r["steps"][0].pop("useful_mfu"), [], "no update mfu measured (the step has none): give --update-mfu"),
    (lambda r: r.update(environment={"gpu": "NVIDIA B200"}), [],
     "the HBM bandwidth of the measured card (NVIDIA B200) is not known: give --card-hbm-tbs"),
    (lambda r: r["plain_generate"].clear(), [], "no decode tokens per s measured (the step has none): "
                                                "give --decode-tokens-per-s"),
    (None, ["--measured-layers", "99"], "--measured-layers 99: qwen3_6_27b has 64 decoder layers (1..64)"),
    (None, ["--measured-shape", "llama"], "--measured-shape: unknown model shape 'llama'"),
    (None, ["--decode-scaling", "flops"], "--decode-scaling 'flops': one of bytes, layers"),
], ids=["no_build_off_h200", "no_mfu", "unknown_card", "no_decode_rate", "layers_out_of_range", "unknown_shape",
        "unknown_decode_rule"])
def test_what_the_projection_cannot_scale_from_exits_2_naming_it(tmp_path, capsys, change, argv, message):
    """One line naming the report, its step and the option that supplies what is missing; exit 2,
    no traceback, no --json written."""
    report = _hybrid_report()
    if change is not None:
        change(report)
    path, out = tmp_path / "step_bench.json", tmp_path / "projection.json"
    path.write_text(json.dumps(report))
    code = main(["--bench", str(path), "--json", str(out), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err and not out.exists()
    assert err.startswith(f"python -m atlas_lightning.bench.projection: --bench {path} (step 2): ") and message in err


def test_the_step_report_records_its_build_and_its_cards_bandwidth(orchestrator_dir):
    """What ``step.py --build`` ran reaches the report the projection reads: the callback takes the
    shape and layers as config values, ``build_report`` writes them; the card's HBM by its name.
    The report plans the run's model (``_plan_at``): the tiny orchestrator's folder, the fixture's."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from atlas_lightning.bench.cards import hbm_tbs
    from atlas_lightning.bench.step import StepBenchCallback, bench_overrides, build_report
    from atlas_lightning.config import compose
    from atlas_lightning.run.callback_arguments import check_callback_arguments

    composed = compose(["experiment=tiny-cpu", *bench_overrides(Path("/tmp/x"), 2, "qwen3_6_27b", 16)])
    arguments = OmegaConf.to_container(composed.callbacks.step_bench, resolve=True)
    arguments.pop("_target_")
    assert arguments == {"out": "/tmp/x", "replay_step": 2, "build": "qwen3_6_27b", "layers": 16}
    check_callback_arguments("step_bench", StepBenchCallback, arguments)
    callback = StepBenchCallback(**arguments)
    assert callback.build == {"shape": "qwen3_6_27b", "layers": 16}
    assert StepBenchCallback(out="/tmp/x", build="dense8b").build == {"shape": "dense8b", "layers": None}
    assert StepBenchCallback(out="/tmp/x").build is None
    cfg = compose(["experiment=tiny-cpu", f"model.path={orchestrator_dir}"])
    report = build_report(cfg, {1: {"timing_s/gen": 1.0}}, rollout_start={1: 0.0}, ended=2.0, callback_s={},
                          lengths={1: [10]}, generated={1: 5}, replayed={}, build=callback.build)
    assert report["build"] == {"shape": "qwen3_6_27b", "layers": 16}
    planned = report["steps"][0]["plan_tensors_gib"]["configured_budgets"]
    assert "error" not in planned and all(phase["tensors_gib"] > 0 for phase in planned.values()), planned
    assert inputs_from_bench({**report, "environment": {"gpu": "NVIDIA H200"}}).measured_layers == 16
    assert (hbm_tbs("NVIDIA H100 80GB HBM3"), hbm_tbs("NVIDIA H200"), hbm_tbs("NVIDIA B200")) == (3.35, 4.8, None)


def _meta_params(layers=None) -> int:
    """The shape's parameters."""
    return sum(p.numel() for p in _meta_model(layers).parameters())


def test_a_merged_sync_scales_by_the_weights_an_engine_card_receives_not_the_adapter():
    """A merged sync moves the base: the 27B's bf16 bytes on one of a TP4 engine's cards against the
    measured model's bytes on its one card. Read from the report's ``rollout.weight_sync``; the
    LoRA rule (adapter size) is what a report without it gets."""
    report = _hybrid_report()
    report["engine"]["weight_sync"] = "merged"
    measured = inputs_from_bench(report)
    assert measured.weight_sync == "merged"
    result = project(measured)
    expected = 2.0 * (_meta_params() * 2 / 4) / (_meta_params(HYBRID_LAYERS) * 2)
    assert result["phases_h200_s"]["update_weights"] == pytest.approx(expected)
    assert result["phases_a100_s"]["update_weights"] == pytest.approx(expected)
    lora = project(inputs_from_bench(_hybrid_report()))
    assert lora["phases_h200_s"]["update_weights"] != pytest.approx(expected)
    assert "the merged sync by the weight bytes an engine's card receives" in markdown(result)
    assert "LoRA sync and the checkpoint" in markdown(lora)
