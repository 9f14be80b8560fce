"""A NaN that reaches the actor loss half-way through a step: the error and
``nonfinite/step_N.json`` say how many optimizer steps of that step were already applied
(by role), and where the update stopped, as the weights in memory show."""

from __future__ import annotations

import dataclasses
import json

import lightning as L
import pytest
import torch

from atlas_lightning.callbacks.nan_guard import NaNGuardCallback, NonFiniteError
from atlas_lightning.config import compose, run_dirs
from atlas_lightning.models.weights import adapter_state
from atlas_lightning.ppo.module import PPOModule
from atlas_lightning.run.memory_check import SyntheticData


class _NaNAtActorMiniBatch(PPOModule):
    """The actor's ``nan_mini_batch``-th micro-step (1-based) of RL step ``nan_step`` gets NaN
    advantages: a real NaN loss and gradient, as a broken batch would give."""

    def __init__(self, cfg, nan_step: int, nan_mini_batch: int):
        super().__init__(cfg)
        self.nan_step, self.nan_mini_batch = nan_step, nan_mini_batch
        self.actor_calls = 0
        self.actor_before: dict[str, torch.Tensor] = {}

    def on_train_batch_start(self, batch, batch_idx):
        self.actor_calls = 0
        if batch.step == self.nan_step:
            self.actor_before = {k: v.clone() for k, v in adapter_state(self.model, "actor").items()}

    def _micro_step(self, role, data, indices, total_tokens, world):
        if role == "actor" and indices:
            self.actor_calls += 1
            if self.rl_step == self.nan_step and self.actor_calls == self.nan_mini_batch:
                data = dataclasses.replace(data, advantages=data.advantages * float("nan"))
        return super()._micro_step(role, data, indices, total_tokens, world)


@pytest.fixture
def cfg(tiny_model_dir, tmp_path):
    return compose([
        "experiment=tiny-cpu", f"model.path={tiny_model_dir}", f"paths.root={tmp_path}", "name=nan",
        "algorithm.train_batch_size=4", "algorithm.ppo_mini_batch_size=1", "algorithm.ppo_epochs=2",
        "algorithm.ppo_max_token_len_per_gpu=64", "algorithm.forward_max_token_len_per_gpu=256",
        "rollout.max_prompt_length=32", "rollout.max_response_length=32", "rollout.max_tokens_per_turn=32",
        "rollout.max_model_len=64", "trainer.total_steps=2",
    ])


def test_the_diagnostic_counts_the_steps_applied_before_the_nan(cfg):
    module = _NaNAtActorMiniBatch(cfg, nan_step=2, nan_mini_batch=4)  # actor: epoch 1, mini-batch 4 of 4
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[NaNGuardCallback(cfg.paths.artifacts, cfg.paths.checkpoints, cfg.name, policy="stop")],
                        default_root_dir=str(run_dirs(cfg)["outputs"]))
    with pytest.raises(NonFiniteError) as caught:
        trainer.fit(module, datamodule=SyntheticData(cfg, steps=2, vocab_size=module_vocab(cfg)))
    message = str(caught.value)
    # critic: 2 epochs x 4 mini-batches, all taken; actor: the first 3 of epoch 1
    assert ("11 optimizer steps of step 2 had been applied before it (critic: 8, actor: 3); the non-finite value "
            "came in the actor update, epoch 1 of 2, mini-batch 4 of 4, whose optimizer step was not taken") in message
    assert "nothing of step 2 is checkpointed" in message
    report = json.loads((run_dirs(cfg)["artifacts"] / "nonfinite" / "step_2.json").read_text())
    assert report["optimizer_steps_applied"] == {"critic": 8, "actor": 3}
    assert report["stopped_at"] == {"role": "actor", "epoch": 0, "mini_batch": 3, "mini_batches_per_epoch": 4,
                                    "epochs": 2}
    assert report["phase"] == "update_actor" and "actor/loss" in report["what"]
    # the claim is true of the weights: the actor moved in step 2, and holds no NaN
    after = adapter_state(module.model, "actor")
    assert any(not torch.equal(after[k], module.actor_before[k]) for k in after)
    assert all(bool(torch.isfinite(t).all()) for t in after.values())


def module_vocab(cfg) -> int:
    from atlas_lightning.run.memory_check import vocab_size_of

    return vocab_size_of(cfg)
