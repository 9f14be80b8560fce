"""A run with LoRA dropout, checkpointed at every step and resumed from step 2, trains step 3
exactly as the uninterrupted run did: the checkpoint holds every rank's random generator states
(``ppo/rng_state.py``) and the resume sets them before the first step. Without them the dropout
masks differ (shown: the same resume with the restore left out trains another step 3).

One process, Lightning's one-file state (``state.ckpt``); the two-rank FSDP2 state (``meta.pt``)
is ``test_cb_checkpoint_ppo_fsdp.py``'s."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import lightning as L
import numpy as np
import torch
from safetensors.torch import load_file

from atlas_lightning.callbacks.checkpoint import StepCheckpoint
from atlas_lightning.config import compose
from atlas_lightning.ppo import rng_state
from atlas_lightning.ppo.module import PPOModule
from atlas_lightning.run.memory_check import vocab_size_of
from atlas_lightning.run.resume_state import check_resume_state
from atlas_lightning.store.checkpoints import lightning_state_path

STEPS = 3


def _worker():
    spec = importlib.util.spec_from_file_location("ppo_checkpoint_worker",
                                                  Path(__file__).with_name("ppo_checkpoint_worker.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fit(model: Path, root: Path, resume_from=None) -> None:
    cfg = compose(["experiment=tiny-cpu", f"model.path={model}", f"paths.root={root}", "name=rng",
                   "model.lora.dropout=0.3", f"trainer.total_steps={STEPS}", "rollout.n=2",
                   "algorithm.train_batch_size=2", "algorithm.ppo_mini_batch_size=1",
                   "algorithm.ppo_max_token_len_per_gpu=256", "algorithm.forward_max_token_len_per_gpu=256"])
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False,
                        callbacks=[StepCheckpoint(root / "checkpoints" / "rng", every_n_steps=1, total_steps=STEPS,
                                                  background=False)])
    data = _worker()._Steps(cfg, STEPS, vocab_size_of(cfg), sequence_tokens=64)
    trainer.fit(PPOModule(cfg, resume_from=resume_from), datamodule=data,
                ckpt_path=str(lightning_state_path(resume_from)) if resume_from else None)


def _adapters(step_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for role in ("actor", "critic"):
        for path in sorted((step_dir / role / "lora_adapter").glob("*.safetensors")):
            out.update({f"{role}/{path.name}/{k}": v for k, v in load_file(path).items()})
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _scramble() -> None:
    """Every global generator somewhere else than where the straight run left it."""
    torch.manual_seed(12345)
    np.random.seed(12345)
    random.seed(12345)


def test_a_resume_with_lora_dropout_trains_the_uninterrupted_run_s_next_step(tiny_model_dir, tmp_path, monkeypatch):
    _fit(tiny_model_dir, tmp_path)
    checkpoints = tmp_path / "checkpoints" / "rng"
    for step in (1, 2, 3):
        check_resume_state(checkpoints / f"global_step_{step}")  # each holds the generator states
    straight = _adapters(checkpoints / "global_step_3")
    assert not all(torch.equal(v, w) for v, w in zip(straight.values(), _adapters(checkpoints / "global_step_2").values()))

    _scramble()
    _fit(tiny_model_dir, tmp_path, resume_from=checkpoints / "global_step_2")
    _assert_same(straight, _adapters(checkpoints / "global_step_3"))

    # the control: the same resume without the restored generators trains another step 3
    monkeypatch.setattr(rng_state, "restore", lambda entry: None)
    _scramble()
    _fit(tiny_model_dir, tmp_path, resume_from=checkpoints / "global_step_2")
    resumed = _adapters(checkpoints / "global_step_3")
    assert any(not torch.equal(straight[key], resumed[key]) for key in straight)
