"""Memory-check mode on CPU with the tiny model: synthetic batches fill the budget, the real PPO
step runs under Lightning, each phase's peak (process resident set on CPU) is reported and
written, and generation is reported as not measured rather than invented."""

from __future__ import annotations

import json

import numpy as np
import pytest

from atlas_lightning.algorithms.partition import plan_micro_batches
from atlas_lightning.cli import main as cli_main
from atlas_lightning.config import compose
from atlas_lightning.run.memory_check import PHASE_NAMES, sequence_lengths, synthetic_batch


def _cfg(tiny_model_dir, sample_data_dir, root, *extra):
    return compose(["experiment=tiny-cpu", f"model.path={tiny_model_dir}", f"data.root={sample_data_dir}",
                    f"paths.root={root}", *extra])


def test_sequence_lengths_fill_the_budget_without_exceeding_it():
    for budget, longest in ((49152, 32768), (8192, 2048), (73728, 32768), (1000, 5000), (98304, 4096)):
        lengths = sequence_lengths(budget, longest)
        assert max(lengths) <= longest and len(set(lengths)) == 1
        assert budget - len(lengths) < sum(lengths) <= budget  # padded n x max fits too: all equal
    with pytest.raises(ValueError, match="budget=1"):
        sequence_lengths(1, 10)


def test_synthetic_batch_is_one_full_micro_batch_per_mini_batch(tiny_model_dir, sample_data_dir, tmp_path):
    cfg = _cfg(tiny_model_dir, sample_data_dir, tmp_path, "algorithm.ppo_max_token_len_per_gpu=3000")
    batch = synthetic_batch(cfg, vocab_size=500, step=3, rank=1)
    minis = cfg.algorithm.train_batch_size // cfg.algorithm.ppo_mini_batch_size
    lengths = batch.sequence_lengths()
    per_mini = len(lengths) // minis
    assert len(lengths) == minis * per_mini and batch.step == 3
    for m in range(minis):
        chunk = lengths[m * per_mini:(m + 1) * per_mini]
        assert 3000 - per_mini < sum(chunk) <= 3000
        assert len(plan_micro_batches(chunk, 3000).micro_batches) == 1
    record = batch.records[0]
    assert len(record.prompt_ids) <= min(1536, cfg.rollout.max_prompt_length)
    assert record.response_mask[-1] == 1 and record.prompt_ids.max() < 500
    assert batch.token_rewards[0][-1] == record.reward_score
    other = synthetic_batch(cfg, vocab_size=500, step=3, rank=0)
    assert not np.array_equal(other.records[0].prompt_ids, record.prompt_ids)  # each rank its own data
    assert batch.metrics()["reward/mapping_sum_error_max"] == 0.0


def test_memory_check_verb_on_cpu_writes_each_phase(tiny_model_dir, sample_data_dir, tmp_path, capsys):
    code = cli_main(["memory-check", "experiment=tiny-cpu", f"model.path={tiny_model_dir}",
                     f"data.root={sample_data_dir}", f"paths.root={tmp_path}", "trainer.memory_check_steps=1",
                     "trainer.memory_check_generation=false",
                     "algorithm.ppo_max_token_len_per_gpu=1024", "algorithm.forward_max_token_len_per_gpu=2048",
                     "algorithm.train_batch_size=4", "algorithm.ppo_mini_batch_size=4", "algorithm.ppo_epochs=1"])
    assert code == 0
    report = json.loads((tmp_path / "outputs" / "tiny-cpu" / "memory_check.json").read_text())
    phases = {row["phase"]: row for row in report["summary"]}
    assert set(phases) == {PHASE_NAMES["actor"], PHASE_NAMES["critic"], "update_critic", "update_actor"}
    for row in phases.values():
        assert 0.05 < row["peak_gib"] < 16  # a Python process holding torch and the tiny model
        assert row["plan_tensors_gib"] > 0
        assert "plan_error" not in row  # a resident set is not comparable to the plan's tensors
    assert "VmHWM" in report["measures"]
    assert report["generation"] == [{"measured": False, "why": "not measured (generation=False)"}]
    assert report["plan"]["device"] == "cpu"
    assert report["lora"] == report["plan"]["model"]["lora"]  # the run's facts, as the plan sized them
    out = capsys.readouterr().out
    assert "update_actor" in out and "generation: not measured" in out
    assert (tmp_path / "outputs" / "tiny-cpu" / "config.yaml").is_file()  # prepare_run wrote the resolved config
