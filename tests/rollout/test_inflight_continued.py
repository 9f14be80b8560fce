"""A resumed run continues the trajectories its checkpoint kept in flight only when it samples the
same steps: a kept step whose trajectories are not the ones this run samples (``rollout.n``,
``data.*`` or ``data.seed`` changed between the launches) is refused by the run's start-up
(``run.facts.check_inputs``, before anything is written), naming the checkpoint and the step,
rather than dropped or mixed with fresh ones. The start-up and the data module read a step's
trajectories through one path (``rollout/step_questions.py``)."""

from __future__ import annotations

import pickle

import pytest

from atlas_lightning.config import ConfigError, compose
from atlas_lightning.errors import InputError
from atlas_lightning.questions.sampler import shard
from atlas_lightning.rollout import inflight
from atlas_lightning.rollout.datamodule import RolloutDataModule
from atlas_lightning.store.checkpoints import MARKER, write_marker
from tests.store.test_checkpoint_verification import _checkpoint


def _cfg(tiny_model_dir, sample_data_dir, tmp_path, *extra):
    return compose([
        "experiment=tiny-cpu", f"model.path={tiny_model_dir}", f"data.root={sample_data_dir}",
        f"paths.root={tmp_path}", "layout=separate_cpu", "rollout=vllm_server_cpu", "layout.partial_rollouts=true",
        "trainer.total_steps=4", "rollout.n=2", "algorithm.train_batch_size=2", "algorithm.ppo_mini_batch_size=1",
        *extra,
    ])


def kept_step_files(cfg, step: int, ranks: int = 1, tokens: int = 3) -> dict[str, bytes]:
    """The in-flight files ``capture`` writes when ``cfg``'s step ``step`` is under way on
    ``ranks`` training ranks, each trajectory ``tokens`` tokens into its first turn."""
    writer = RolloutDataModule(cfg, engine=object())
    writer.setup()
    trajectories = writer.train_trajectories(step)
    for traj in trajectories:
        traj.response_ids, traj.response_mask = list(range(5, 5 + tokens)), [1] * tokens
        traj.response_logprobs, traj.response_versions = [-0.5] * tokens, [step - 1] * tokens
    return {inflight.FILE_PATTERN.format(rank=rank): pickle.dumps({"format": inflight.FORMAT, "rank": rank, "steps": [
        {"step": step, "version": step - 1, "trajectories": shard(trajectories, rank, ranks)}]})
        for rank in range(ranks)}


def checkpoint_keeping(cfg, root, step: int, ranks: int = 1):
    """``root/global_step_<step - 1>``: a complete checkpoint (``checkpoint.json`` lists its
    ``inflight/`` files) that keeps ``cfg``'s step ``step`` in flight (``kept_step_files``)."""
    folder = _checkpoint(root, step - 1)
    inflight.write(kept_step_files(cfg, step, ranks), folder)
    (folder / MARKER).unlink()
    write_marker(folder, step - 1)
    return folder


def test_kept_steps_of_the_same_settings_pass_the_start_up_and_are_restored(tiny_model_dir, sample_data_dir,
                                                                            tmp_path):
    from atlas_lightning.run.facts import check_inputs

    cfg = _cfg(tiny_model_dir, sample_data_dir, tmp_path)
    folder = checkpoint_keeping(cfg, tmp_path / "elsewhere", 2)
    resume = [f"trainer.resume={folder}"]
    assert check_inputs(_cfg(tiny_model_dir, sample_data_dir, tmp_path, *resume)).start.resume == folder
    resumed = RolloutDataModule(cfg, engine=object(), resume_from=folder)
    resumed.setup()
    assert {(t.uid, t.session_id) for t in resumed.async_steps.restored[2].trajectories} == resumed.steps.keys(2)


@pytest.mark.parametrize("changed", [["rollout.n=1"], ["rollout.n=3"], ["data.seed=12345"],
                                     ["data.shuffle=false", "data.seed=3"]])
def test_kept_steps_of_other_settings_are_refused_before_anything_is_written(tiny_model_dir, sample_data_dir,
                                                                             tmp_path, changed):
    from atlas_lightning.run.facts import check_inputs

    folder = checkpoint_keeping(_cfg(tiny_model_dir, sample_data_dir, tmp_path, "data.seed=3"),
                                tmp_path / "elsewhere", 2)
    with pytest.raises(ConfigError) as refused:
        check_inputs(_cfg(tiny_model_dir, sample_data_dir, tmp_path, "data.seed=3", *changed,
                          f"trainer.resume={folder}"))
    message = str(refused.value)
    assert message.startswith(f"trainer.resume={folder}: {folder}: step 2 in flight"), message
    assert "trainer.init_from" in message and "resume with" in message
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "logs").exists()


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
