"""The weight sync is the PPO step's last phase: the engines serve the step-N weights before any
callback's ``on_train_batch_end`` (validation of step N) and before step N + 1's rollout, because
of where it sits (the end of ``training_step``; the starting weights in ``on_fit_start``), not
because of the order of the callbacks. A fit with only ``conf/callbacks/none.yaml`` still syncs.

Through the real ``PPOModule``, ``RolloutDataModule``, ``ValidationCallback`` and the step
checkpoint; the engine is the transformers reference engine (CPU, no vLLM), which serves the
exported adapter and answers the probe."""

from __future__ import annotations

import json
from types import SimpleNamespace

import lightning as L
import torch

from atlas_lightning.config import compose, run_dirs

STEPS = 2


class _Served(L.Callback):
    """The weights version the datamodule says its engine serves, at every hook a step's work reads
    it from; and the version each training batch was sampled with."""

    def __init__(self) -> None:
        self.at_train_start: list = []
        self.at_batch_end: dict[int, object] = {}
        self.sampled_with: dict[int, object] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.at_train_start.append(trainer.datamodule.weights_version)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.at_batch_end[batch.step] = trainer.datamodule.weights_version
        self.sampled_with[batch.step] = batch.weights_version


def test_the_step_syncs_before_validation_and_the_next_rollout_with_no_sync_callback(
        tiny_model_dir, sample_data_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from atlas_lightning.callbacks.validation import ValidationCallback
    from atlas_lightning.loggers.wandb_logger import build_loggers
    from atlas_lightning.ppo.module import PPOModule
    from atlas_lightning.rollout.datamodule import RolloutDataModule
    from atlas_lightning.rollout.engines.hf_engine import HFEngine
    from atlas_lightning.run.wiring import build_callbacks, build_trainer, prepare_run

    cfg = compose(["experiment=tiny-cpu", f"model.path={tiny_model_dir}", f"data.root={sample_data_dir}",
                   f"paths.root={tmp_path}", "name=stage", "logger.mode=disabled", "callbacks=none",
                   f"trainer.total_steps={STEPS}", "trainer.save_every=0", "rollout.n=2",
                   "algorithm.train_batch_size=2", "algorithm.ppo_mini_batch_size=1", "rollout.max_tokens_per_turn=12",
                   "rollout.max_turns=2", "rollout.val_n=1", "data.val_max_questions=1", "rollout.max_in_flight=4"])
    prepare_run(cfg, "fit")
    configured = build_callbacks(cfg)
    assert [type(c).__name__ for c in configured] == ["StepCheckpoint"]  # none.yaml: nothing that syncs
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    datamodule = RolloutDataModule(cfg, engine=engine)
    served = _Served()
    # validation listed FIRST, before anything else: it still samples the step-N weights
    validation = ValidationCallback(artifacts=cfg.paths.artifacts, checkpoints=cfg.paths.checkpoints, run_id=cfg.name,
                                    val_every=1, val_before_train=True, val_on_last_step=True)
    loggers = build_loggers(cfg)
    trainer = build_trainer(cfg, callbacks=[validation, served, *configured], loggers=loggers)
    trainer.fit(PPOModule(cfg), datamodule=datamodule)

    assert served.at_train_start == [0]  # the starting weights, served before any on_train_start
    assert served.at_batch_end == {step: step for step in range(1, STEPS + 1)}  # synced inside the step
    assert served.sampled_with == {step: step - 1 for step in range(1, STEPS + 1)}  # strictly on-policy
    assert validation.validated == list(range(STEPS + 1))
    for step in range(STEPS + 1):  # each validation sampled the weights of its own step
        manifest = json.loads((run_dirs(cfg)["artifacts"] / "val" / f"step_{step}" / "manifest.json").read_text())
        assert manifest["weights_version"] == step, step

    history = {int(row["_step"]): row for row in loggers[-1].history()}
    for step in range(STEPS + 1):  # the sync's metrics keep their names and their RL step
        row = history[step]
        for key in ("rollout/logprob_gap", "rollout/logprob_gap_bound", "timing_s/update_weights", "timing_s/wake",
                    "rollout/sync_tensor_count"):
            assert float(row[key]) >= 0.0, (step, key)
        assert float(row["rollout/logprob_gap"]) <= float(row["rollout/logprob_gap_bound"])
    # the starting sync loads three times (the actor, the marked actor, the actor), each later one
    # twice (the marked actor, the actor: rollout.marked_check_every 1; rollout/sync_probe.py)
    assert (run_dirs(cfg)["outputs"] / ".engine_adapters" / f"sync{2 * STEPS + 3}").is_dir()


def test_the_starting_sync_comes_after_the_checkpoint_restore_whichever_the_strategy(tmp_path):
    """Lightning restores a checkpoint before ``on_fit_start`` under one device, after it under
    FSDP2 (``ModelParallelStrategy.restore_checkpoint_after_setup``): the starting sync runs in
    ``on_fit_start`` unless a resume's restore is still to come, and then in ``on_train_start``
    (a resumed run validates nothing before training). Exactly once either way."""
    from atlas_lightning.ppo.module import PPOModule

    cfg = compose(["experiment=tiny-cpu", f"paths.root={tmp_path}"])
    for after_setup, resume_from, expected in ((False, None, "on_fit_start"), (True, None, "on_fit_start"),
                                               (False, tmp_path, "on_fit_start"), (True, tmp_path, "on_train_start")):
        module = PPOModule(cfg, resume_from=resume_from)
        module.trainer = SimpleNamespace(strategy=SimpleNamespace(restore_checkpoint_after_setup=after_setup),
                                         global_rank=0)
        module.rl_step = 7
        calls = []
        for hook in ("on_fit_start", "on_train_start"):
            module.sync_weights = lambda version, hook=hook: calls.append((hook, version))
            getattr(module, hook)()
        assert calls == [(expected, 7)], (after_setup, resume_from, calls)
