"""A reward scorer from outside the package, chosen by ``reward._target_``: it is built from the
composed config with its own keys, scores real rollouts (the transformers engine on the tiny
model) through the real batch assembly, and its values are what the token rewards, the records
and the reward metrics hold; through the CLI it trains a step and lands in the step folder.
A scorer that breaks the contract, or a target that does not exist, is refused by name."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from atlas_lightning.config import ConfigError, compose
from atlas_lightning.reward import CostReward, build_scorer, score_trajectory

#: Written to tmp_path: the package is not edited, the scorer is the user's own module.
PLUGIN = '''
"""A user's reward: a flat charge per assistant turn, the rest as the cost reward's breakdown."""
from atlas_lightning.reward import CostReward
from atlas_lightning.reward.placement import place_rewards


class TurnCharge:
    def __init__(self, cost_per_usd, no_submit_reward, correct_bonus, turn_charge):
        self.cost = CostReward(cost_per_usd, no_submit_reward)
        self.correct_bonus, self.turn_charge = correct_bonus, turn_charge

    def __call__(self, episode):
        breakdown = dict(self.cost(episode)["reward"])
        value = self.correct_bonus * breakdown["acc"] - self.turn_charge * episode["num_turns"]
        breakdown.update(training_reward=value, final_reward=value, turn_charge=self.turn_charge)
        # the whole reward on the last generated token; zero on every explore's turn (events)
        pieces = {f"explore_reward_{k}": 0.0 for k in range(1, 65)}
        pieces["terminal_reward"] = value
        return {"reward": breakdown, "reward_trace": place_rewards(episode, pieces)}


class Broken:
    def __init__(self, cost_per_usd, no_submit_reward):
        pass

    def __call__(self, episode):
        return {"reward": {"training_reward": 1.0}, "reward_trace": {"offsets": [], "values": []}}
'''

BONUS, CHARGE = 2.0, 0.25  # exact in binary: sums compare exactly


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "user_rewards_plugin.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    sys.modules.pop("user_rewards_plugin", None)


def _overrides(tiny_model_dir, sample_data_dir, root) -> list[str]:
    return ["experiment=tiny-cpu", f"model.path={tiny_model_dir}", f"data.root={sample_data_dir}",
            f"paths.root={root}", "reward._target_=user_rewards_plugin.TurnCharge",
            f"+reward.correct_bonus={BONUS}", f"+reward.turn_charge={CHARGE}", "rollout.n=2",
            "algorithm.train_batch_size=2", "algorithm.ppo_mini_batch_size=1", "rollout.max_tokens_per_turn=24",
            "rollout.max_turns=3"]


def _expected(record) -> float:
    """The user's formula, from the record's runtime facts alone."""
    return BONUS * record.reward["acc"] - CHARGE * record.episode["num_turns"]


def test_a_reward_from_outside_the_package_scores_the_rollouts(plugin_dir, tiny_model_dir, sample_data_dir,
                                                                tmp_path):
    from transformers import AutoModelForCausalLM

    from atlas_lightning.rollout.datamodule import RolloutDataModule
    from atlas_lightning.rollout.engines.hf_engine import HFEngine

    cfg = compose(_overrides(tiny_model_dir, sample_data_dir, tmp_path))
    assert cfg.reward.correct_bonus == BONUS and cfg.reward._target_ == "user_rewards_plugin.TurnCharge"
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    dm = RolloutDataModule(cfg, engine=engine)
    assert type(dm.scorer).__module__ == "user_rewards_plugin"
    dm.setup("fit")
    batch = dm.rollout(1)

    assert len(batch) == 4
    for record, rewards in zip(batch.records, batch.token_rewards):
        value = _expected(record)
        assert record.reward_score == value == record.reward["training_reward"]
        assert record.reward["turn_charge"] == CHARGE
        # the whole reward on the last generated token, nothing elsewhere: what PPO receives
        last = int(np.flatnonzero(record.response_mask)[-1])
        expected = np.zeros(len(record.response_ids), dtype=np.float32)
        expected[last] = value
        np.testing.assert_array_equal(rewards, expected)
        assert last in record.reward_trace["offsets"]
    metrics = batch.metrics()
    assert metrics["reward/turn_charge"] == CHARGE
    assert metrics["reward/training_reward"] == pytest.approx(np.mean([_expected(r) for r in batch.records]))
    # the framework's invariants, computed on the token rewards: zero for a scorer that keeps the contract
    assert metrics["reward/mapping_sum_error_max"] == 0.0 and metrics["reward/mapped_slots_minus_events_max"] == 0
    # the package's reward would have scored every one of these episodes otherwise
    cost = CostReward(cost_per_usd=cfg.reward.cost_per_usd)
    assert all(cost(r.episode)["reward"]["training_reward"] != r.reward_score for r in batch.records)


def test_a_reward_from_outside_the_package_trains_through_the_cli(plugin_dir, tiny_model_dir, sample_data_dir,
                                                                  tmp_path):
    root = tmp_path / "run"
    command = [sys.executable, "-m", "atlas_lightning.cli", "fit", *_overrides(tiny_model_dir, sample_data_dir, root),
               "name=plugin", "rollout.engine=hf", "trainer.total_steps=1", "trainer.save_every=0",
               "trainer.val_before_train=false", "callbacks.validation.val_on_last_step=false",
               "callbacks.figures=null", "logger.mode=disabled"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(plugin_dir), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="2", WANDB_MODE="disabled")
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-4000:]

    from atlas_lightning.store.records import read_record, read_step_tensors, verify_manifest

    folder = root / "artifacts" / "plugin" / "train" / "step_1"
    assert verify_manifest(folder) == []
    records = [read_record(p) for p in sorted(folder.glob("*_*.json"))]
    tensors = read_step_tensors(folder / "tensors.npz")
    assert len(records) == 4  # 2 questions x 2 samples
    index = {(u, s): i for i, (u, s) in enumerate(zip(tensors["uid"], tensors["session_id"]))}
    for record in records:
        value = _expected(record)
        assert record.reward_score == value and record.reward["turn_charge"] == CHARGE
        i = index[(record.uid, record.session_id)]
        last = int(np.flatnonzero(tensors["response_mask"][i])[-1])
        expected = np.zeros(len(tensors["response_mask"][i]), dtype=np.float32)
        expected[last] = value
        np.testing.assert_array_equal(tensors["token_rewards"][i], expected)  # what PPO trained on


def test_a_scorer_off_contract_or_missing_is_named(plugin_dir, tmp_path, build):
    episode = build.question()
    with pytest.raises(ConfigError, match=r"reward\._target_='no_such_pkg\.Reward': no module no_such_pkg"):
        compose(["experiment=tiny-cpu", "reward._target_=no_such_pkg.Reward"])
    with pytest.raises(ConfigError, match=r"reward\._target_.*cannot build the reward scorer"):
        build_scorer(compose(["experiment=tiny-cpu", "reward._target_=user_rewards_plugin.TurnCharge"]).reward)

    from atlas_lightning.env.episode import Episode, RuntimeConfig

    ep = Episode(episode, 0, RuntimeConfig(max_explores=8, max_turns=3), seed=0)
    build.run(ep, [build.call("submit", {"answer": "B"})])
    scorer = build_scorer(compose(["experiment=tiny-cpu", "reward._target_=user_rewards_plugin.Broken"]).reward)
    with pytest.raises(ValueError, match=r"reward scorer Broken on trajectory t/n000: the breakdown lacks "
                                         r"final_reward, acc, objective, cost, cost_total, num_explores"):
        score_trajectory(scorer, ep.to_record_episode(), 20, where="trajectory t/n000")
