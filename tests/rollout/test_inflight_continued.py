"""A resumed run continues the trajectories its checkpoint kept in flight only when it samples the
same steps: a kept step whose trajectories are not the ones this run samples (``rollout.n``,
``data.*`` or ``data.seed`` changed between the launches) is refused as the datamodule restores
it, naming the checkpoint and the step, rather than dropped or mixed with fresh ones."""

from __future__ import annotations

import pickle

import pytest

from atlas_lightning.config import compose
from atlas_lightning.errors import InputError
from atlas_lightning.rollout import inflight
from atlas_lightning.rollout.datamodule import RolloutDataModule


def _cfg(tiny_model_dir, sample_data_dir, tmp_path, *extra):
    return compose([
        "experiment=tiny-cpu", f"model.path={tiny_model_dir}", f"data.root={sample_data_dir}",
        f"paths.root={tmp_path}", "layout=separate_cpu", "layout.partial_rollouts=true", "trainer.total_steps=4",
        "rollout.n=2", "algorithm.train_batch_size=2", "algorithm.ppo_mini_batch_size=1", *extra,
    ])


def _checkpoint_keeping_step_2(cfg, folder):
    """``folder`` (a ``global_step_1``) keeping step 2 of ``cfg`` in flight, as ``capture`` writes it."""
    writer = RolloutDataModule(cfg, engine=object())
    writer.setup()
    steps = [{"step": 2, "version": 1, "trajectories": writer.train_trajectories(2)}]
    inflight.write({"rank_0.pkl": pickle.dumps({"format": inflight.FORMAT, "rank": 0, "steps": steps})}, folder)


def test_kept_steps_of_the_same_settings_are_restored(tiny_model_dir, sample_data_dir, tmp_path):
    cfg = _cfg(tiny_model_dir, sample_data_dir, tmp_path)
    folder = tmp_path / "global_step_1"
    _checkpoint_keeping_step_2(cfg, folder)
    resumed = RolloutDataModule(cfg, engine=object(), resume_from=folder)
    resumed.setup()
    assert {(t.uid, t.session_id) for t in resumed.async_steps.restored[2].trajectories} == resumed.sampled_keys(2)


@pytest.mark.parametrize("changed", [["rollout.n=1"], ["rollout.n=3"], ["data.seed=12345"],
                                     ["data.shuffle=false", "data.seed=3"]])
def test_kept_steps_of_other_settings_are_refused_naming_checkpoint_and_step(tiny_model_dir, sample_data_dir,
                                                                             tmp_path, changed):
    folder = tmp_path / "global_step_1"
    _checkpoint_keeping_step_2(_cfg(tiny_model_dir, sample_data_dir, tmp_path, "data.seed=3"), folder)
    resumed = RolloutDataModule(_cfg(tiny_model_dir, sample_data_dir, tmp_path, "data.seed=3", *changed),
                                engine=object(), resume_from=folder)
    with pytest.raises(InputError) as refused:
        resumed.setup()
    message = str(refused.value)
    assert str(folder) in message and "step 2" in message
    assert "trainer.init_from" in message and "resume with" in message


def test_the_producer_refuses_a_fresh_trajectory_its_kept_step_lacks():
    from atlas_lightning.rollout.agent_loop import Trajectory
    from atlas_lightning.rollout.trajectory_producer import OpenStep, TrajectoryProducer

    def trajectory(uid, session):
        return Trajectory(uid=uid, session_id=session, episode=None, prompt_ids=[1])

    class Source:
        def train_trajectories(self, step):
            return [trajectory("q1", "n000"), trajectory("q1", "n001")]

    producer = TrajectoryProducer.__new__(TrajectoryProducer)
    producer.source = Source()
    kept = OpenStep(2, [trajectory("q1", "n000")], 1)
    with pytest.raises(InputError, match=r"step 2 .*q1/n001"):
        producer._mine(2, kept)
