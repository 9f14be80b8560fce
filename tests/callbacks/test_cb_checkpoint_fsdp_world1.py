"""One GPU trains under FSDP2 at world 1 (``ModelParallelStrategy``, as ``run/wiring.py`` sets it up
for GPU runs): its Lightning state is a torch.distributed checkpoint folder, as at world 8, and
``trainer.resume`` finds it and continues the run. Here through gloo on CPU, one process.

The format follows the strategy, not the world size: when it followed the world size, a
one-GPU run saved a distributed checkpoint *folder* named ``lightning/state.ckpt``, which
``lightning_state_path`` (looking for a file there) passed over, and the resume failed."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy

from atlas_lightning.callbacks.checkpoint import StepCheckpoint
from atlas_lightning.config import run_dirs
from atlas_lightning.store.checkpoints import STATE_DIR, latest_complete, lightning_state_path


@pytest.fixture
def gloo_world_one():
    yield
    if dist.is_available() and dist.is_initialized():  # later tests must not find a process group
        dist.destroy_process_group()


def _sharded_module(h, cfg):
    class Sharded(h.ScriptedModule):
        def configure_model(self):
            from torch.distributed.fsdp import fully_shard

            if not hasattr(self.critic.weight, "full_tensor"):
                fully_shard(self.critic, mesh=self.device_mesh["data_parallel"])

        def save_adapters(self, step_dir):
            full = self.critic.weight.full_tensor()  # collective: every rank
            if self.trainer.is_global_zero:
                h.write_adapters(step_dir, full)

    return Sharded(cfg)


class _Crash(RuntimeError):
    pass


class _CrashAt(L.Callback):
    """The process dies during step ``step`` (after its update, before anything is saved)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch.step == self.step:
            raise _Crash(f"crash during step {self.step}")


def _fit(h, cfg, chat, callbacks=(), ckpt_path=None):
    module, dm = _sharded_module(h, cfg), h.ScriptedDataModule(cfg, chat)
    trainer = h.make_trainer([*callbacks, StepCheckpoint(every_n_steps=2)],
                             strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1))
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    return module, dm


def test_world_one_fsdp2_saves_a_distributed_checkpoint_and_resumes(tmp_path, h, chat, gloo_world_one):
    cfg = h.make_cfg(tmp_path, total_steps=4)
    with pytest.raises(_Crash):
        _fit(h, cfg, chat, callbacks=[_CrashAt(3)])
    folder = latest_complete(run_dirs(cfg)["checkpoints"])
    assert folder is not None and folder.name == "global_step_2"
    state = lightning_state_path(folder)
    assert state == folder / STATE_DIR and state.is_dir()
    assert (state / ".metadata").is_file()  # torch.distributed.checkpoint's own index

    from safetensors.torch import load_file

    saved = load_file(str(folder / "critic" / "lora_adapter" / "adapter_model.safetensors"))["weight"]
    resumed, dm = _fit(h, cfg, chat, callbacks=[_RestoredWeights()], ckpt_path=str(state))
    assert sorted(resumed.outputs) == [3, 4]  # steps 1-2 are not sampled again
    assert dm.next_step == 5 and resumed.optimizer_steps == 2
    assert torch.equal(resumed.restored_weight, saved)  # step 3 started from the saved weights


class _RestoredWeights(L.Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        pl_module.restored_weight = pl_module.critic.weight.full_tensor().detach().clone()
