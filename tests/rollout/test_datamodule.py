"""RolloutDataModule on the real vLLM CPU engine and the tiny model: a 4 x 4 rollout end to end,
strict on-policy sampling under Lightning, exact resume, and clear engine faults."""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch

from atlas_lightning.config import compose
from atlas_lightning.rollout.datamodule import RolloutDataModule
from atlas_lightning.env.terminal import terminal_reason_code

pytestmark = pytest.mark.vllm


def _cfg(tiny_model_dir, sample_data_dir, tmp_path, *extra):
    return compose([
        "experiment=tiny-cpu", f"model.path={tiny_model_dir}", f"data.root={sample_data_dir}",
        f"paths.root={tmp_path}", "rollout.n=4", "algorithm.train_batch_size=4",
        "algorithm.ppo_mini_batch_size=2", "rollout.max_tokens_per_turn=48", *extra,
    ])


@pytest.fixture
def datamodule(tiny_model_dir, sample_data_dir, tmp_path, vllm_engine):
    vllm_engine.set_adapter(None)
    dm = RolloutDataModule(_cfg(tiny_model_dir, sample_data_dir, tmp_path), engine=vllm_engine)
    dm.setup("fit")
    return dm


def test_four_by_four_rollout_end_to_end(datamodule):
    batch = datamodule.rollout(1)
    assert len(batch) == 16 and batch.step == 1 and batch.partition == "train"
    questions = {r.question_id for r in batch.records}
    assert len(questions) == 4
    for record, rewards in zip(batch.records, batch.token_rewards):
        n = len(record.response_ids)
        assert n > 0 and len(record.response_mask) == n == len(record.response_logprobs) == len(rewards)
        generated = record.response_mask.astype(bool)
        assert np.all(record.response_logprobs[generated] <= 0) and np.all(record.response_logprobs[~generated] == 0)
        assert record.reward["terminal_reason_code"] == terminal_reason_code(record.episode["terminal_reason"])
        assert rewards.sum() == pytest.approx(record.reward["final_reward"], abs=1e-6)
        assert record.global_steps == 1 and record.partition == "train"
    metrics = batch.metrics()
    assert metrics["reward/mapping_sum_error_max"] == 0.0
    assert metrics["reward/mapped_slots_minus_events_max"] == 0


def test_generated_tokens_are_kept_verbatim(datamodule):
    """Each turn's tokens equal what the engine returns for the same seeded request, and the
    sequence is never re-tokenized (decode + encode would change byte-level BPE ids)."""
    batch = datamodule.rollout(2)
    record = batch.records[0]
    mask = record.response_mask.astype(bool)
    first_turn_end = int(np.argmin(mask)) if not mask.all() else len(mask)
    first_turn = record.response_ids[:first_turn_end].tolist()
    again = datamodule.rollout(2).records[0]
    assert again.response_ids[:first_turn_end].tolist() == first_turn


def test_resumed_datamodule_samples_what_an_uninterrupted_one_would(datamodule, tiny_model_dir, sample_data_dir,
                                                                    tmp_path, vllm_engine):
    uninterrupted = [datamodule.rollout(step) for step in (1, 2)]
    datamodule.next_step = 2
    state = datamodule.state_dict()
    resumed = RolloutDataModule(_cfg(tiny_model_dir, sample_data_dir, tmp_path), engine=vllm_engine)
    resumed.setup("fit")
    resumed.load_state_dict(state)
    assert resumed.next_step == 2
    batch = next(iter(resumed.train_dataloader()))
    assert batch.step == 2
    expected = uninterrupted[1]
    assert [r.question_id for r in batch.records] == [r.question_id for r in expected.records]
    assert [r.response_ids.tolist() for r in batch.records] == [r.response_ids.tolist() for r in expected.records]
    assert [r.reward_score for r in batch.records] == [r.reward_score for r in expected.records]


class _StepRecorder(L.LightningModule):
    """Takes a real optimizer step per batch and records which weights each batch saw."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append((batch.step, batch.weights_version))
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward((self.weight - 1.0).pow(2).sum())
        opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD([self.weight], lr=0.1)

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return batch


class _Sync(L.Callback):
    """Stands where the weight sync stands: after each update, the engine serves version N."""

    def on_train_start(self, trainer, pl_module):
        trainer.datamodule.weights_version = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        trainer.datamodule.weights_version = batch.step


def test_synchronous_mode_is_on_policy_under_lightning(tiny_model_dir, sample_data_dir, tmp_path, vllm_engine):
    cfg = _cfg(tiny_model_dir, sample_data_dir, tmp_path, "trainer.total_steps=3", "rollout.n=2",
               "algorithm.train_batch_size=2", "algorithm.ppo_mini_batch_size=1", "rollout.max_tokens_per_turn=8")
    dm = RolloutDataModule(cfg, engine=vllm_engine)
    module = _StepRecorder()
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[_Sync()])
    trainer.fit(module, datamodule=dm)
    # Batch N was sampled with the weights after N - 1 updates: never one ahead.
    assert module.seen == [(1, 0), (2, 1), (3, 2)]


def test_a_length_less_dataset_would_be_prefetched(tiny_model_dir, sample_data_dir, tmp_path, vllm_engine):
    """The trap the sized dataset avoids: Lightning fetches one batch ahead of a length-less one."""
    from torch.utils.data import DataLoader, IterableDataset

    cfg = _cfg(tiny_model_dir, sample_data_dir, tmp_path, "trainer.total_steps=3", "rollout.n=2",
               "algorithm.train_batch_size=2", "algorithm.ppo_mini_batch_size=1", "rollout.max_tokens_per_turn=8")

    class LengthLess(IterableDataset):
        def __init__(self, dm):
            self.dm = dm

        def __iter__(self):
            for step in range(1, 4):
                yield self.dm.rollout(step)

    class Unsized(RolloutDataModule):
        def train_dataloader(self):
            return DataLoader(LengthLess(self), batch_size=None, collate_fn=lambda b: b)

    dm = Unsized(cfg, engine=vllm_engine)
    module = _StepRecorder()
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[_Sync()])
    trainer.fit(module, datamodule=dm)
    assert module.seen != [(1, 0), (2, 1), (3, 2)]


_DEAD_ENGINE_SCRIPT = """
import sys
from dataclasses import replace
from atlas_lightning.config import compose
from atlas_lightning.rollout.datamodule import RolloutDataModule
from atlas_lightning.rollout.engine import EngineError
from atlas_lightning.rollout.engines.args import EngineArgs
from atlas_lightning.rollout.engines.vllm_engine import VLLMEngine

model, data, root = sys.argv[1:4]
cfg = compose(["experiment=tiny-cpu", f"model.path={model}", f"data.root={data}", f"paths.root={root}",
               "rollout.n=2", "algorithm.train_batch_size=2", "algorithm.ppo_mini_batch_size=1",
               "rollout.max_tokens_per_turn=16", "rollout.max_retries=1"])
engine = VLLMEngine(replace(EngineArgs.from_config(cfg), lora_rank=None))
dm = RolloutDataModule(cfg, engine=engine)
dm.setup("fit")
engine._engine.engine_core.shutdown()  # the engine core is gone mid-run
try:
    dm.rollout(1)
except EngineError as err:
    print("ENGINE_ERROR:", err)
    sys.exit(0)
print("NO ERROR")
sys.exit(1)
"""


@pytest.mark.e2e  # each engine entry point of a dead engine in make test: tests/rollout/test_engine_failure.py
def test_a_dead_engine_gives_a_clear_error_and_no_batch(tiny_model_dir, sample_data_dir, tmp_path):
    """In its own process: vLLM's in-process engine state is process-wide."""
    import os
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _DEAD_ENGINE_SCRIPT, str(tiny_model_dir), str(sample_data_dir),
                             str(tmp_path)], capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    message = next(line for line in result.stdout.splitlines() if line.startswith("ENGINE_ERROR:"))
    # a dead engine is not retried (``Engine.failure``): the first failure stops the rollout, named
    assert "failed 1 time in a row" in message and "trajectories unfinished" in message
    assert "failed during a generation step" in message
    assert "the step is not recorded" in message
