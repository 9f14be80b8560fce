"""One GPU trains under ``ModelParallelStrategy`` at world 1 (``TrainableStateStrategy``, as
``run/wiring.py`` sets it up for GPU runs; the model unsharded: one rank has nothing to share): its Lightning state is a torch.distributed checkpoint folder, as at world 8, and
``trainer.resume`` finds it and continues the run. Here through gloo on CPU, one process.

Two defects this guards against. The format followed the world size, so a one-GPU run saved a
distributed checkpoint *folder* named ``lightning/state.ckpt``, which ``lightning_state_path``
(looking for a file there) passed over. And Lightning's ``ModelParallelStrategy`` asked the
checkpoint for every key of the module, the frozen base too, which the PPO module never saves:
no FSDP2 run (eight cards either) could resume ("Missing key in checkpoint state_dict").

And one order: ``ModelParallelStrategy`` restores a checkpoint after ``on_fit_start``, so a
resumed FSDP2 run serves its starting weights from ``on_train_start`` (``PPOModule``'s own
hooks here): the restored weights, as version N, not the fresh ones as version 0."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist

from atlas_lightning.config import run_dirs
from atlas_lightning.run.strategy import TrainableStateStrategy
from atlas_lightning.store.checkpoints import STATE_DIR, latest_complete, lightning_state_path


@pytest.fixture
def gloo_world_one():
    there_before = dist.is_available() and dist.is_initialized()  # e.g. an in-process vLLM engine's
    yield
    if not there_before and dist.is_initialized():  # later tests must not find the group this test made
        dist.destroy_process_group()


class _Crash(RuntimeError):
    pass


class _CrashAt(L.Callback):
    """The process dies during step ``step`` (after its update, before anything is saved)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch.step == self.step:
            raise _Crash(f"crash during step {self.step}")


def _fit(h, cfg, chat, callbacks=(), ckpt_path=None, resume_from=None):
    module, dm = h.sharded_module(cfg, resume_from), h.ScriptedDataModule(cfg, chat)
    trainer = h.make_trainer([*callbacks, h.callback(cfg, "checkpoint", every_n_steps=2)],
                             strategy=TrainableStateStrategy(data_parallel_size=1, tensor_parallel_size=1))
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    return module, dm


def test_world_one_fsdp2_saves_a_distributed_checkpoint_and_resumes(tmp_path, h, chat, gloo_world_one):
    cfg = h.make_cfg(tmp_path, total_steps=4)
    with pytest.raises(_Crash):
        _fit(h, cfg, chat, callbacks=[_CrashAt(3)])  # a fresh run: served from on_fit_start, version 0
    folder = latest_complete(run_dirs(cfg)["checkpoints"])
    assert folder is not None and folder.name == "global_step_2"
    state = lightning_state_path(folder)
    assert state == folder / STATE_DIR and state.is_dir()
    assert (state / ".metadata").is_file()  # torch.distributed.checkpoint's own index

    from safetensors.torch import load_file

    saved = load_file(str(folder / "critic" / "lora_adapter" / "adapter_model.safetensors"))["weight"]
    resumed, dm = _fit(h, cfg, chat, callbacks=[_RestoredWeights()], ckpt_path=str(state), resume_from=folder)
    assert sorted(resumed.outputs) == [3, 4]  # steps 1-2 are not sampled again
    # the starting sync came after the restore (on_train_start), with step 2's weights as version 2,
    # under an engine-side id the checkpoint carried on (never reused)
    assert [version for version, _ in resumed.served] == [2] and torch.equal(resumed.served[0][1], saved)
    assert resumed.weight_sync.sync_id == 2
    assert dm.next_step == 5 and resumed.optimizer_steps == 2
    assert torch.equal(resumed.restored_weight, saved)  # step 3 started from the saved weights
    assert resumed.restored_adam_steps == [2.0]  # and from Adam's state after step 2
    assert resumed.rl_step == 4


class _RestoredWeights(L.Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        pl_module.restored_weight = pl_module.critic.weight.full_tensor().detach().clone()
        optimizer = trainer.optimizers[0]
        pl_module.restored_adam_steps = [float(state["step"]) for state in optimizer.state.values()]


class _StateAsGathered(L.Callback):
    """What the strategy gathered for a checkpoint, before the module's own ``on_save_checkpoint``
    (Lightning calls the callbacks' hook first)."""

    def __init__(self) -> None:
        self.keys: list[set[str]] = []

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.keys.append(set(checkpoint["state_dict"]))


def test_a_checkpoint_never_gathers_the_frozen_base(tmp_path, h, chat, gloo_world_one):
    """Lightning's own strategy copied every tensor to the host and the module then dropped the
    frozen base: on the 8B shape, 16 GB copied at every checkpoint for nothing."""
    cfg = h.make_cfg(tmp_path, total_steps=2)
    spy = _StateAsGathered()
    module, _ = _fit(h, cfg, chat, callbacks=[spy])
    assert spy.keys, "no checkpoint was saved"
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    for keys in spy.keys:
        assert not any(key.startswith("base.") for key in keys), keys
        assert trainable <= keys


class _LiveShards(L.Callback):
    """At each step's end, before the checkpoint (Lightning runs checkpoint callbacks last): where
    the critic's weight shard and its first AdamW moment live."""

    def __init__(self) -> None:
        self.at: list[tuple[int, int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        weight = pl_module.critic.weight
        moment = trainer.optimizers[0].state[weight]["exp_avg"]
        self.at.append((weight.to_local().data_ptr(), moment.to_local().data_ptr()))


def test_the_sharded_state_reaches_the_stager_as_the_live_shards(tmp_path, h, chat, gloo_world_one, monkeypatch):
    """One host copy of the trainable state a checkpoint: torch's stager makes it (``async_save``),
    from the shards where they live. Lightning's strategy offloaded them to the host first
    (``cpu_offload``): on a card, two copies of the same bytes, both inside the step."""
    from torch.distributed.checkpoint import state_dict as dcp_state_dict

    from atlas_lightning.callbacks import checkpoint_write

    offloaded: list[str] = []
    for name in ("get_model_state_dict", "get_optimizer_state_dict"):
        def spy(*args, _real=getattr(dcp_state_dict, name), _name=name, **kwargs):
            options = kwargs.get("options")
            if options is not None and options.cpu_offload:
                offloaded.append(_name)
            return _real(*args, **kwargs)
        monkeypatch.setattr(dcp_state_dict, name, spy)
    staged: list[tuple[int, int]] = []

    def async_save(tensors, **kwargs):
        moment = tensors["optimizer_0"]["state"]["critic.weight"]["exp_avg"]
        staged.append((tensors["state_dict"]["critic.weight"].to_local().data_ptr(), moment.to_local().data_ptr()))
        return real_async_save(tensors, **kwargs)

    real_async_save = checkpoint_write.async_save
    monkeypatch.setattr(checkpoint_write, "async_save", async_save)
    live = _LiveShards()
    cfg = h.make_cfg(tmp_path, total_steps=2)
    _fit(h, cfg, chat, callbacks=[live])
    assert offloaded == [] and staged == [live.at[1]]  # step 2's save: the live shards, no copy yet
    assert latest_complete(run_dirs(cfg)["checkpoints"]).name == "global_step_2"
