"""The step checkpoint's host copies are kept for the run and reused from one save to the next
(``HostStaging`` in ``callbacks/checkpoint_write.py``): each save copies into the memory the
previous save was staged in, so every checkpoint must still hold its own step's state, never the
next one's, with one process (``state.ckpt``) and with FSDP2 (a torch.distributed checkpoint
folder), and nothing may stage while a write still reads those copies. On CPU: plain host memory,
copied at once (pinned memory and copies without waiting are for CUDA), reused all the same."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from atlas_lightning.callbacks import checkpoint_write
from atlas_lightning.callbacks.checkpoint_write import HostStaging, StagedCheckpoint
from atlas_lightning.config import run_dirs
from atlas_lightning.models.adapters import HostBuffers
from atlas_lightning.ppo import optimizer_state
from atlas_lightning.run.strategy import TrainableStateStrategy
from atlas_lightning.store.checkpoints import verify_checkpoint

STEPS = (1, 2, 3, 4)


def test_staging_again_reuses_the_host_copies_and_the_first_was_right_when_written(tmp_path):
    """Also with a class object in the state, as Lightning's checkpoint holds: a stager that torch
    closes after each stage (``DefaultStager`` in torch 2.11) failed the second one on it, and
    copied afresh every time."""
    weight, moment = torch.randn(4, 3), torch.randn(4, 3)
    staging = HostStaging(on_cuda=False)
    staging.begin(1)
    first = staging.stage({"state_dict": {"w": weight}, "optimizer": {"exp_avg": moment}, "step": 1,
                           "hyper_parameters": {"optimizer_class": torch.optim.AdamW}})
    first_bytes = (first["state_dict"]["w"].clone(), first["optimizer"]["exp_avg"].clone())
    assert torch.equal(first_bytes[0], weight) and first["state_dict"]["w"].data_ptr() != weight.data_ptr()
    torch.save(first, tmp_path / "first.pt")  # the write of the first save, before the second stages
    staging.lend(_written(1))

    weight.add_(1.0), moment.mul_(2.0)  # the next step's update, in place (the storages stay)
    staging.begin(2)
    second = staging.stage({"state_dict": {"w": weight}, "optimizer": {"exp_avg": moment}, "step": 2,
                            "hyper_parameters": {"optimizer_class": torch.optim.AdamW}})
    assert second["hyper_parameters"]["optimizer_class"] is torch.optim.AdamW
    assert second["state_dict"]["w"].data_ptr() == first["state_dict"]["w"].data_ptr()
    assert second["optimizer"]["exp_avg"].data_ptr() == first["optimizer"]["exp_avg"].data_ptr()
    assert torch.equal(second["state_dict"]["w"], weight) and torch.equal(second["optimizer"]["exp_avg"], moment)
    written = torch.load(tmp_path / "first.pt", weights_only=False)
    assert torch.equal(written["state_dict"]["w"], first_bytes[0]) and written["step"] == 1
    assert torch.equal(written["optimizer"]["exp_avg"], first_bytes[1])
    staging.close()


def test_host_buffers_are_reused_by_name_and_remade_for_another_shape():
    buffers = HostBuffers()
    source = torch.arange(6.0)
    first = buffers.copy("actor/a", source)
    kept = first.clone()
    source.add_(10.0)
    second = buffers.copy("actor/a", source)
    assert second.data_ptr() == first.data_ptr() and torch.equal(second, source) and not torch.equal(kept, source)
    assert buffers.copy("critic/a", source).data_ptr() != first.data_ptr()  # another name, another buffer
    assert buffers.copy("actor/a", torch.zeros(2, 2)).shape == (2, 2)


def test_nothing_stages_while_a_write_still_reads_the_copies():
    staging = HostStaging(on_cuda=False)
    staging.begin(1)
    in_flight = staging.lend(_staged(1))
    with pytest.raises(RuntimeError, match="the write of step 1's still reads the host copies"):
        staging.begin(2)
    in_flight.finished.set()  # the write ended (well or not)
    staging.begin(2)  # a staging that fails midway (no lend) blocks the next one
    with pytest.raises(RuntimeError, match="the staging of step 2's failed midway"):
        staging.begin(3)


class _Watch(L.Callback):
    """At each step's end, before the checkpoint (Lightning runs checkpoint callbacks last): the
    critic's weight and its first AdamW moment, whole."""

    def __init__(self) -> None:
        self.weights: dict[int, torch.Tensor] = {}
        self.moments: dict[int, torch.Tensor] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        weight = pl_module.critic.weight
        moment = trainer.optimizers[0].state[weight]["exp_avg"]
        self.weights[batch.step] = _whole(weight).detach().clone()
        self.moments[batch.step] = _whole(moment).detach().clone()


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class _StagedPointers:
    """Where each save's host copies of the critic's weight went: the Lightning state's (the
    stager) and the adapters' (``HostBuffers``)."""

    def __init__(self, monkeypatch) -> None:
        self.state: list[int] = []
        self.adapters: list[int] = []
        record = self

        class RecordingStager(checkpoint_write.ReusedHostStager):
            def stage(self, state_dict):
                staged = super().stage(state_dict)
                if "state_dict" in staged:
                    local = staged["state_dict"]["critic.weight"]
                    record.state.append((local.to_local() if hasattr(local, "to_local") else local).data_ptr())
                return staged

        real_copy = HostBuffers.copy

        def copy(buffers, name, tensor):
            copied = real_copy(buffers, name, tensor)
            record.adapters.append(copied.data_ptr())
            return copied

        monkeypatch.setattr(checkpoint_write, "ReusedHostStager", RecordingStager)
        monkeypatch.setattr(HostBuffers, "copy", copy)

    def assert_reused(self, saves: int, state_warmed: bool = False) -> None:
        """``saves`` saves staged into the same memory, made at the fit's start (``warm_staging``)
        for the adapters always, for Lightning's state where the moments existed then."""
        assert len(self.state) == saves + state_warmed and len(set(self.state)) == 1, self.state
        assert len(self.adapters) == saves + 1 and len(set(self.adapters)) == 1, self.adapters


def _assert_each_checkpoint_holds_its_own_step(checkpoints, watch: _Watch, read_state) -> None:
    for before, after in zip(STEPS, STEPS[1:]):  # every step changed what the next save overwrites
        assert not torch.equal(watch.weights[before], watch.weights[after])
        assert not torch.equal(watch.moments[before], watch.moments[after])
    for step in STEPS:
        folder = checkpoints / f"global_step_{step}"
        verify_checkpoint(folder)
        weight, moment = read_state(folder)
        assert torch.equal(weight, watch.weights[step]) and torch.equal(moment, watch.moments[step]), step
        adapter = load_file(str(folder / "critic" / "lora_adapter" / "adapter_model.safetensors"))["weight"]
        assert torch.equal(adapter, watch.weights[step]), step


def test_one_process_checkpoints_staged_in_reused_copies_each_hold_their_own_step(tmp_path, h, chat, monkeypatch):
    pointers = _StagedPointers(monkeypatch)
    cfg = h.make_cfg(tmp_path, total_steps=len(STEPS))
    # each write outlasts the next step: every save waits for the previous write, then overwrites its copies
    module = h.slow_disk(_AdamModule(h, cfg), from_step=1, seconds=0.5)
    watch, saver = _Watch(), h.callback(cfg, "checkpoint", every_n_steps=1)
    h.make_trainer([watch, saver]).fit(module, datamodule=h.ScriptedDataModule(cfg, chat))

    def read_state(folder):
        state = torch.load(folder / "lightning" / "state.ckpt", weights_only=False)
        return state["state_dict"]["critic.weight"], state["optimizer_states"][0]["state"][0]["exp_avg"]

    _assert_each_checkpoint_holds_its_own_step(run_dirs(cfg)["checkpoints"], watch, read_state)
    pointers.assert_reused(len(STEPS))
    assert saver._staging is None  # let go at the fit's end


def test_the_full_disk_fault_passes_the_buffers_on(tmp_path, h, chat, monkeypatch):
    """``FaultInjection``'s full disk wraps ``snapshot_adapters``: the step checkpoint's buffers
    still reach the module, and the write of the chosen step fails as it did."""
    from atlas_lightning.callbacks.checkpoint import CheckpointWriteError
    from atlas_lightning.callbacks.faults import FaultInjection

    pointers = _StagedPointers(monkeypatch)
    cfg = h.make_cfg(tmp_path, total_steps=4)
    with pytest.raises(CheckpointWriteError, match="checkpoint of step 2 could not be written.*No space left"):
        h.make_trainer([FaultInjection("checkpoint_write", step=2), h.callback(cfg, "checkpoint", every_n_steps=1)]
                       ).fit(_AdamModule(h, cfg), datamodule=h.ScriptedDataModule(cfg, chat))
    pointers.assert_reused(2)  # steps 1 and 2 staged into the same memory (step 3's end raised first)


@pytest.fixture
def gloo_world_one():
    there_before = dist.is_available() and dist.is_initialized()
    yield
    if not there_before and dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("moments_first", [False, True], ids=["lazy-moments", "moments-first"])
def test_fsdp2_checkpoints_staged_in_reused_copies_each_hold_their_own_step(tmp_path, h, chat, monkeypatch,
                                                                           gloo_world_one, moments_first):
    """``moments-first``: the moments made before the fit, as ``PPOModule`` makes them: the
    sharded state is staged at the fit's start too, and every save reuses that memory."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    pointers = _StagedPointers(monkeypatch)
    cfg = h.make_cfg(tmp_path, total_steps=len(STEPS))
    module = h.slow_disk(h.sharded_module(cfg), from_step=1, seconds=0.5)
    if moments_first:
        lazy = module.configure_optimizers

        def configure_optimizers():
            optimizer = lazy()
            optimizer_state.allocate(optimizer)
            return optimizer

        module.configure_optimizers = configure_optimizers
    watch, saver = _Watch(), h.callback(cfg, "checkpoint", every_n_steps=1)
    trainer = h.make_trainer([watch, saver], strategy=TrainableStateStrategy(data_parallel_size=1,
                                                                            tensor_parallel_size=1))
    trainer.fit(module, datamodule=h.ScriptedDataModule(cfg, chat))

    def read_state(folder):
        dcp_to_torch_save(folder / "lightning", tmp_path / f"{folder.name}.pt")
        state = torch.load(tmp_path / f"{folder.name}.pt", weights_only=False)
        return state["state_dict"]["critic.weight"], state["optimizer_0"]["state"]["critic.weight"]["exp_avg"]

    _assert_each_checkpoint_holds_its_own_step(run_dirs(cfg)["checkpoints"], watch, read_state)
    pointers.assert_reused(len(STEPS), state_warmed=moments_first)
    assert saver._staging is None


def _AdamModule(h, cfg, moments_first: bool = False):
    """The scripted module trained with AdamW: its checkpoints hold optimizer moments, made at the
    first step, or before the fit with ``moments_first`` (as ``PPOModule`` makes them)."""

    class AdamModule(h.ScriptedModule):
        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=0.05)
            if moments_first:
                optimizer_state.allocate(optimizer)
            return optimizer

    return AdamModule(cfg)


def test_moments_made_before_the_fit_are_staged_at_its_start_and_the_first_save_reuses_that_memory(
        tmp_path, h, chat, monkeypatch):
    """On a card the stager pins the host copies it makes, which blocked step 1's checkpoint; with
    the moments made before the fit, every tensor the saves stage exists at the fit's start, and
    the first save copies into memory made then. The training and the checkpoints are unchanged."""
    pointers = _StagedPointers(monkeypatch)
    runs = {}
    for moments_first in (True, False):
        L.seed_everything(0, verbose=False)  # the same start for both runs
        cfg = h.make_cfg(tmp_path / str(moments_first), total_steps=len(STEPS))
        watch, saver = _Watch(), h.callback(cfg, "checkpoint", every_n_steps=1)
        h.make_trainer([watch, saver]).fit(_AdamModule(h, cfg, moments_first),
                                           datamodule=h.ScriptedDataModule(cfg, chat))
        runs[moments_first] = (cfg, watch)
        if moments_first:
            pointers.assert_reused(len(STEPS), state_warmed=True)
            pointers.state.clear()
            pointers.adapters.clear()
    pointers.assert_reused(len(STEPS))  # made at the first step: nothing of the state to stage at the start
    (cfg, watch), (_, lazy) = runs[True], runs[False]
    for step in STEPS:  # the same training either way
        assert torch.equal(watch.weights[step], lazy.weights[step]) and torch.equal(watch.moments[step], lazy.moments[step])

    def read_state(folder):
        state = torch.load(folder / "lightning" / "state.ckpt", weights_only=False)
        return state["state_dict"]["critic.weight"], state["optimizer_states"][0]["state"][0]["exp_avg"]

    _assert_each_checkpoint_holds_its_own_step(run_dirs(cfg)["checkpoints"], watch, read_state)
    assert sorted(p.name for p in run_dirs(cfg)["checkpoints"].glob("global_step_*")) == \
        [f"global_step_{step}" for step in STEPS]  # the start wrote nothing


def _staged(step: int) -> StagedCheckpoint:
    return StagedCheckpoint(step, checkpoints=None, write_adapters=lambda folder: None, state=None)


def _written(step: int) -> StagedCheckpoint:
    staged = _staged(step)
    staged.finished.set()
    return staged
