"""RolloutDataModule in the separate layout under Lightning (the transformers reference engine
stands in for the server: the producer's logic is what is tested here; the server itself is in
tests/e2e/test_separate_layout.py): step k+1 is sampled while update k runs, staleness is
recorded and bounded, and the data cursor counts trained steps, so a resumed run samples the
prefetched step again."""

from __future__ import annotations

import time

import lightning as L
import pytest
import torch

from atlas_lightning.config import compose
from atlas_lightning.rollout.datamodule import RolloutDataModule
from atlas_lightning.rollout.engines.hf_engine import HFEngine


def _cfg(tiny_model_dir, sample_data_dir, tmp_path, *extra):
    return compose([
        "experiment=tiny-cpu", f"model.path={tiny_model_dir}", f"data.root={sample_data_dir}",
        f"paths.root={tmp_path}", "layout=separate_cpu", "trainer.total_steps=3", "rollout.n=1",
        "algorithm.train_batch_size=2", "algorithm.ppo_mini_batch_size=1", "rollout.max_tokens_per_turn=8",
        "rollout.max_turns=3", *extra,
    ])


@pytest.fixture(scope="module")
def hf_engine(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return HFEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))


class _SlowUpdates(L.LightningModule):
    """A real optimizer step per batch that takes ``update_s``; records what each batch was."""

    def __init__(self, update_s: float):
        super().__init__()
        self.automatic_optimization = False
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.update_s = update_s
        self.seen, self.spans = [], {}

    def training_step(self, batch, batch_idx):
        started = time.monotonic()
        self.seen.append((batch.step, batch.weights_version, batch.staleness,
                          tuple(r.question_id for r in batch.records), batch.staleness_counts, batch.dropped))
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward((self.weight - 1.0).pow(2).sum())
        opt.step()
        time.sleep(self.update_s)
        self.spans[batch.step] = (started, time.monotonic())

    def configure_optimizers(self):
        return torch.optim.SGD([self.weight], lr=0.1)

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return batch


class _Sync(L.Callback):
    """Stands where the weight sync stands (holding the engine lock); records the data cursor
    Lightning would checkpoint after each step."""

    def __init__(self):
        self.cursors = []

    def on_train_start(self, trainer, pl_module):
        with trainer.datamodule.engine_lock:
            trainer.datamodule.weights_version = pl_module.current_version = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        dm = trainer.datamodule
        with dm.engine_lock:
            dm.weights_version = batch.step
        self.cursors.append(dm.state_dict())


def test_rollouts_overlap_updates_with_bounded_staleness(hf_engine, tiny_model_dir, sample_data_dir, tmp_path):
    dm = RolloutDataModule(_cfg(tiny_model_dir, sample_data_dir, tmp_path), engine=hf_engine)
    starts = {}
    rollout = dm.rollout

    def timed(step):
        starts[step] = time.monotonic()
        return rollout(step)

    dm.rollout = timed
    module, sync = _SlowUpdates(update_s=1.0), _Sync()
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[sync])
    trainer.fit(module, datamodule=dm)

    # (step, version sampled with, staleness): step 1 on the initial weights, then one behind
    assert [s[:3] for s in module.seen] == [(1, 0, 0), (2, 0, 1), (3, 1, 1)]
    # the histogram of the trajectories' staleness (2 a step), nothing dropped under "wait"
    assert [s[4:] for s in module.seen] == [({0: 2, 1: 0}, 0), ({0: 0, 1: 2}, 0), ({0: 0, 1: 2}, 0)]

    for k in (1, 2):  # rollout k+1 started once batch k was handed over, before update k ended
        assert starts[k] < starts[k + 1] < module.spans[k][1], (k, starts, module.spans)
    # the cursor counts trained steps, not sampled ones (step k+1 was sampled when k was saved)
    assert [cursor["next_step"] for cursor in sync.cursors] == [k + 1 for k in (1, 2, 3)]
    # and the sampling it counts steps of, which a resume compares with its own
    assert [cursor["sampling"] for cursor in sync.cursors] == [dm.steps.digest] * 3
    assert dm.producer is None or not dm.producer.alive

    # Resume after step 2: the prefetched step 3 is sampled again, the same questions.
    resumed = RolloutDataModule(_cfg(tiny_model_dir, sample_data_dir, tmp_path), engine=hf_engine)
    resumed.setup("fit")
    resumed.load_state_dict(sync.cursors[1])
    resumed.weights_version = 2  # the checkpoint's weights
    batches = iter(resumed.train_dataloader())
    batch = next(batches)
    assert (batch.step, batch.weights_version, batch.staleness) == (3, 2, 0)
    assert tuple(r.question_id for r in batch.records) == module.seen[2][3]
    resumed.teardown("fit")


class _DrawsMasks(_SlowUpdates):
    """Each update draws from the global generators as LoRA dropout does (torch's; numpy's and
    Python's too), the first one right after seeding them: what it draws is a function of the
    seeds alone unless another thread draws from them too."""

    SEED = 1234

    def __init__(self, update_s: float):
        super().__init__(update_s)
        self.masks = []

    def training_step(self, batch, batch_idx):
        if batch_idx == 0:
            _seed_globals(self.SEED)
        self.masks.append(_draw_globals())
        time.sleep(self.update_s / 2)  # the producer samples the next step meanwhile
        self.masks.append(_draw_globals())
        super().training_step(batch, batch_idx)


def _seed_globals(seed: int) -> None:
    import random

    import numpy as np

    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def _draw_globals() -> tuple:
    import random

    import numpy as np

    return (torch.rand(8) > 0.5).tolist(), np.random.rand(2).tolist(), random.random()


def test_the_producer_thread_draws_nothing_from_the_global_generators(hf_engine, tiny_model_dir, sample_data_dir,
                                                                     tmp_path):
    """The separate layout samples on a producer thread while the update draws its LoRA dropout
    masks from the process's global generators: were the rollout side (engine, agent loop,
    episodes, reward) to draw from them, the masks would depend on how the two threads
    interleave, and a resumed run would draw other masks than the run it continues. Sampled at
    temperature 1 (the engine draws from a generator of each request's seed): every mask is the
    one the seeds alone give."""
    module = _DrawsMasks(update_s=1.0)
    _fit(RolloutDataModule(_cfg(tiny_model_dir, sample_data_dir, tmp_path, "rollout.temperature=1.0"),
                           engine=hf_engine), module)
    assert [s[:3] for s in module.seen] == [(1, 0, 0), (2, 0, 1), (3, 1, 1)]  # sampled during the updates
    _seed_globals(_DrawsMasks.SEED)
    assert module.masks == [_draw_globals() for _ in module.masks]


def test_synchronous_layout_never_prefetches(hf_engine, tiny_model_dir, sample_data_dir, tmp_path):
    dm = RolloutDataModule(_cfg(tiny_model_dir, sample_data_dir, tmp_path, "layout=single", "trainer.total_steps=3"),
                           engine=hf_engine)
    module, sync = _SlowUpdates(update_s=0.0), _Sync()
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[sync])
    trainer.fit(module, datamodule=dm)
    assert [s[:3] for s in module.seen] == [(1, 0, 0), (2, 1, 0), (3, 2, 0)]
    assert all(s[4:] == ({}, 0) for s in module.seen)  # no histogram, nothing dropped: as before
    assert dm.producer is None


def test_drop_policy_samples_ahead_and_drops_what_falls_over_the_bound(hf_engine, tiny_model_dir, sample_data_dir,
                                                                      tmp_path):
    """``drop``: the producer does not wait for weights, only for room; step 3, sampled with v0
    during update 1, is two versions behind when taken: its trajectories are dropped and the step
    is sampled again at once (no step skipped)."""
    module = _SlowUpdates(update_s=4.0)
    _fit(RolloutDataModule(_cfg(tiny_model_dir, sample_data_dir, tmp_path, "layout.staleness_policy=drop"),
                           engine=hf_engine), module)
    assert [s[:3] for s in module.seen] == [(1, 0, 0), (2, 0, 1), (3, 2, 0)]
    assert [s[4:] for s in module.seen] == [({0: 2, 1: 0}, 0), ({0: 0, 1: 2}, 0), ({0: 2, 1: 0}, 2)]
    assert all(len(s[3]) == 2 for s in module.seen)


def _fit(dm: RolloutDataModule, module: L.LightningModule) -> None:
    L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, callbacks=[_Sync()]).fit(module, datamodule=dm)
