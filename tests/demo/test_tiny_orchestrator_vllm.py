"""The SFT warm start on a real engine: vLLM's CPU build serving it through the trainer's own
datamodule and agent loop, on the validation split, greedy and sampled.

The warm-started model (``DEFAULT_RECIPE``, seed 0) is built in the background while the other
tests run, and cached (``orchestrator_dir`` in ``conftest.py``).
"""

from __future__ import annotations

import json

import pytest

from atlas_lightning.demo.tiny_orchestrator import summarize_episodes

pytestmark = pytest.mark.vllm


def _rollout(cfg_overrides: list[str], engine) -> dict:
    from atlas_lightning.config import compose
    from atlas_lightning.rollout.datamodule import RolloutDataModule

    dm = RolloutDataModule(compose(cfg_overrides), engine=engine)
    dm.setup("fit")
    batch = dm.validation_rollout(0)
    summary = summarize_episodes([record.episode for record in batch.records])
    submitted = [r for r in batch.records if r.episode["terminal_reason"] == "submitted"]
    summary["submitted_rate"] = len(submitted) / len(batch.records)
    # A submit carries a readable answer: a letter (GPQA) or a #k (LCB; an unrevealed k is graded wrong).
    readable = ("letter", "candidate_ref", "unrevealed_ref")
    summary["readable_answer_rate"] = sum(
        next(e for e in r.episode["events"] if e["type"] == "submit")["grading"]["rule"] in readable
        for r in submitted) / max(len(submitted), 1)
    return summary


def test_warm_started_model_submits_valid_calls_with_varied_explores(orchestrator_dir, sample_data_dir, tmp_path,
                                                                     tiny_engine_args):
    from atlas_lightning.rollout.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(tiny_engine_args(model=str(orchestrator_dir)))
    try:
        base = ["experiment=tiny-cpu", f"model.path={orchestrator_dir}", f"data.root={sample_data_dir}",
                f"paths.cache={tmp_path}", f"paths.root={tmp_path}", "data.val_max_questions=16", "rollout.val_n=1"]
        greedy = _rollout(base + ["rollout.val_temperature=0.0"], engine)
        # three samples a question: one sample of 32 questions is too few for an accuracy claim
        sampled = _rollout(base + ["rollout.val_temperature=1.0", "rollout.val_n=3"], engine)
    finally:
        engine.close()
    print("\nSFT warm start on vLLM, validation split (16 GPQA + 16 LCB questions):")
    print("greedy ", json.dumps(greedy, sort_keys=True))
    print("sampled", json.dumps(sampled, sort_keys=True))
    sft = json.loads((orchestrator_dir / "sft_summary.json").read_text())
    print("build  ", json.dumps({k: sft[k] for k in ("steps", "final_loss", "seconds")}))

    assert greedy["episodes"] == 32 and sampled["episodes"] == 96
    for summary in (greedy, sampled):
        assert summary["submitted_rate"] >= 0.8, summary["terminal_reasons"]
        assert summary["readable_answer_rate"] >= 0.9
    # Sampling explores a varied number of times: PPO has a stop decision to learn.
    assert len(sampled["explores"]) >= 4, sampled["explores"]
    # Above chance: a random letter is right 1 time in 4 on GPQA and a guessed #k never on LCB;
    # copying revealed answers does better. Sampled over 96 episodes (the policy's sampled accuracy
    # measured on 576 validation episodes is ~0.38, so 0.25 leaves ~2.5 standard errors).
    assert greedy["by_benchmark"]["gpqa"]["acc"] > 0.25
    assert greedy["acc"] > 0.4
    assert sampled["acc"] > 0.25
