"""Sleep mode in a colocated fit: the engine sleeps after each training rollout (the update gets
its memory) and the weight sync wakes it before it touches the engine; validation rollouts never
put it to sleep; the step logs the sleep, the wake and the rollout's parts. On CPU vLLM has no
sleep, so a transformers engine that keeps the rules (no request, adapter or probe while
asleep) stands in for it, through the real PPOModule, callbacks and datamodule."""

from __future__ import annotations

import torch

from atlas_lightning.config import compose
from atlas_lightning.rollout.engine import EngineError
from atlas_lightning.rollout.engines.hf_engine import HFEngine


class SleepyEngine(HFEngine):
    """``HFEngine`` with a sleep that refuses work while asleep, as vLLM's does; records calls."""

    sleeps = True

    def __init__(self, model) -> None:
        super().__init__(model)
        self.asleep = False
        self.calls: list[str] = []

    def _awake(self, what: str) -> None:
        self.calls.append(what)
        if self.asleep:
            raise EngineError(f"{what} while asleep")

    def submit(self, request):
        self._awake("submit")
        return super().submit(request)

    def set_adapter(self, adapter):
        self._awake("set_adapter")
        return super().set_adapter(adapter)

    def prompt_logprobs(self, token_ids):
        self._awake("prompt_logprobs")
        return super().prompt_logprobs(token_ids)

    def sleep(self) -> None:
        self.calls.append("sleep")
        self.asleep = True

    def wake_up(self) -> None:
        self.calls.append("wake_up")
        self.asleep = False


def _collapse(calls: list[str]) -> list[str]:
    out: list[str] = []
    for call in calls:
        if not out or out[-1] != call:
            out.append(call)
    return out


def test_the_engine_sleeps_through_each_update_and_the_sync_wakes_it(tiny_model_dir, sample_data_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from atlas_lightning.loggers.wandb_logger import build_loggers
    from atlas_lightning.ppo.module import PPOModule
    from atlas_lightning.rollout.datamodule import RolloutDataModule
    from atlas_lightning.run.wiring import build_callbacks, build_trainer, prepare_run

    cfg = compose(["experiment=tiny-cpu", f"model.path={tiny_model_dir}", f"data.root={sample_data_dir}",
                   f"paths.root={tmp_path}", "name=sleepy", "logger.mode=disabled", "rollout.enable_sleep_mode=true",
                   "trainer.total_steps=2", "trainer.val_every=0", "trainer.save_every=0",
                   "rollout.n=2", "algorithm.train_batch_size=2", "algorithm.ppo_mini_batch_size=1",
                   "rollout.max_tokens_per_turn=12", "rollout.max_turns=2", "rollout.val_n=1",
                   "data.val_max_questions=1", "rollout.max_in_flight=4"])
    prepare_run(cfg, "fit")
    engine = SleepyEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    datamodule = RolloutDataModule(cfg, engine=engine)
    loggers = build_loggers(cfg)
    trainer = build_trainer(cfg, callbacks=build_callbacks(cfg), loggers=loggers)
    trainer.fit(PPOModule(cfg), datamodule=datamodule)

    calls = _collapse(engine.calls)
    # validation before training (awake), then per step: rollout, sleep, the sync wakes, adapter, probe
    assert calls[0] in ("wake_up", "set_adapter") and "sleep" in calls
    assert calls.count("sleep") == 2  # one per training rollout, none for the validations
    for i, call in enumerate(calls):
        if call == "sleep":
            assert calls[i + 1] == "wake_up" and calls[i + 2] == "set_adapter", calls
    assert not engine.asleep

    history = {int(row["_step"]): row for row in loggers[-1].history()}
    for step in (1, 2):
        row = history[step]
        for key in ("timing_s/gen", "timing_s/sleep", "timing_s/wake", "timing_s/assemble", "timing_s/rollout",
                    "timing_s/update_weights", "timing_s/update_actor"):
            assert float(row[key]) >= 0.0, key
        assert float(row["timing_s/rollout"]) >= float(row["timing_s/gen"]) + float(row["timing_s/sleep"])
        assert not any(key.startswith("memory/") for key in row)  # peaks are CUDA figures only


def test_an_engine_without_sleep_mode_is_never_put_to_sleep(tiny_model_dir, sample_data_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from atlas_lightning.rollout.datamodule import RolloutDataModule

    cfg = compose(["experiment=tiny-cpu", f"model.path={tiny_model_dir}", f"data.root={sample_data_dir}",
                   f"paths.root={tmp_path}", "rollout.enable_sleep_mode=false", "rollout.n=1",
                   "algorithm.train_batch_size=1", "algorithm.ppo_mini_batch_size=1", "rollout.max_tokens_per_turn=8",
                   "rollout.max_turns=1"])
    engine = SleepyEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    datamodule = RolloutDataModule(cfg, engine=engine)
    datamodule.setup("fit")
    batch = datamodule.rollout(1)
    assert "sleep" not in engine.calls and "timing_s/sleep" not in batch.timing and "sleep" not in batch.timing
