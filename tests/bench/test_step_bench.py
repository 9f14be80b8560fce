"""The end-to-end step benchmark on CPU (the tiny model, vLLM's CPU build): one ``fit`` through the
CLI with the benchmark's callback; every phase of the step is timed, the callbacks' own time and
the rest add up to the step's wall time, and the step's requests replayed through plain
``vllm.LLM.generate`` give the comparison. The numbers are not checked (they are CPU numbers);
what the report holds is."""

from __future__ import annotations

import json
import time

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.e2e]  # tests/bench/test_bench_smoke.py in make test


def test_one_step_is_timed_phase_by_phase_and_compared_with_plain_generate(tiny_model_dir, sample_data_dir,
                                                                          tmp_path):
    from atlas_lightning.bench.step import main

    out = tmp_path / "bench"
    started = time.monotonic()
    code = main(["--out", str(out), "--", "experiment=tiny-cpu", f"model.path={tiny_model_dir}",
                 f"data.root={sample_data_dir}", f"paths.root={tmp_path}", "name=stepbench", "logger.mode=disabled",
                 "trainer.total_steps=1", "trainer.val_before_train=false", "trainer.save_every=0",
                 "data.val_max_questions=1", "rollout.val_n=1", "rollout.n=2", "algorithm.train_batch_size=2",
                 "algorithm.ppo_mini_batch_size=1", "rollout.max_tokens_per_turn=16", "rollout.max_turns=3"])
    assert code == 0
    elapsed = time.monotonic() - started
    report = json.loads((out / "step_bench.json").read_text())
    assert [row["step"] for row in report["steps"]] == [1]
    row = report["steps"][0]
    assert row["trajectories"] == 4 and row["generated_tokens"] > 0
    for phase in ("gen", "assemble", "old_log_prob", "values", "adv", "update_critic", "update_actor", "wake",
                  "update_weights", "testing"):
        assert row["phases_s"][phase] >= 0.0, phase
    assert {"ValidationCallback", "StepCheckpoint", "ArtifactDumpCallback"} <= set(row["callbacks_s"])
    assert "WeightSyncCallback" not in row["callbacks_s"]  # the sync is the step's phases wake and update_weights
    inside = sum(row["phases_s"].get(p, 0.0) for p in ("wake_rollout", "gen", "sleep", "assemble", "old_log_prob",
                                                       "values", "ref", "adv", "update_critic", "update_actor",
                                                       "wake", "update_weights"))
    assert row["other_s"] == pytest.approx(row["wall_s"] - inside - sum(row["callbacks_s"].values()))
    parts = row["other_parts"]  # measured: the rollout call's and training_step's own seconds beyond their phases
    assert parts["rollout"] >= 0 and parts["training_step"] >= 0
    assert sum(parts.values()) == pytest.approx(row["other_s"])
    assert {"export", "engine_load", "engine_probe", "trainer_probe"} <= set(row["sync_s"])
    assert 0 < row["shares"]["generation"] < 1 and 0 < row["shares"]["update_compute"] < 1
    assert row["micro_batch_tokens"]["update"] > 0 and row["plan_tensors_gib"]["configured_budgets"]
    plain = report["plain_generate"]
    assert plain["done"] and plain["step"] == 1 and plain["generated_tokens"] == row["generated_tokens"]
    assert plain["gen_vs_plain"] > 0
    # what the user waits for outside the steps: the engine's start and the trainer's build before
    # the first rollout, the closing after training; with the step, within the whole call
    edges = report["fit_edges_s"]
    assert edges["opening"] > 0 and edges["closing"] >= 0
    assert edges["opening"] + row["wall_s"] + edges["closing"] < elapsed
    text = (out / "step_bench.md").read_text()
    assert "| gen (card used) |" in text and "fit around its steps: opening" in text
