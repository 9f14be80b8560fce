"""Checkpoints are verified against their own ``checkpoint.json`` (file list, sizes, sha256)
before a run resumes from or starts from them; ``trainer.resume=auto`` falls back to the newest
one that verifies and says so; a resume onto another base or other LoRA target modules is
refused naming the key and the checkpoint, before Lightning loads anything."""

from __future__ import annotations

import json
import re

import pytest
import torch

from atlas_lightning.config import ConfigError, compose
from tests.conftest import write_fake_model_folder
from atlas_lightning.store.checkpoints import (
    MARKER,
    CheckpointError,
    checkpoint_step,
    latest_verified,
    verify_checkpoint,
    write_marker,
)


#: ``experiment=tiny-cpu``'s learning rates: a state's optimizers were set up with them.
TINY_LR = {"actor": 2.0e-3, "critic": 1.0e-3}


def resumable_state(**change) -> dict:
    """A Lightning state of the shape a resume restores (two AdamW optimizers with their moments,
    loops, callbacks, the data cursor, the module's record, every rank's generator states), with
    ``change`` applied."""
    import torch

    from atlas_lightning.ppo.rng_state import RNG_KEY, capture

    def adam(names, lr):
        return {"state": {i: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)}
                          for i in range(len(names))}, "param_groups": [{"params": list(range(len(names))), "lr": lr}]}

    # the tensors of ``_checkpoint``'s adapters (``_FAKE_ADAPTER``): two LoRA factors a role, the critic's value head
    trained = {f"m.{factor}.{role}.weight": torch.zeros(2) for role in ("actor", "critic") for factor in ("lora_A", "lora_B")}
    state = {"state_dict": {**trained, "m.value_head.weight": torch.zeros(2)}, "optimizer_states": [adam("ab", TINY_LR["actor"]), adam("cde", TINY_LR["critic"])],
             "loops": {"fit_loop": {}}, "callbacks": {"ValidationCallback": {"validated": [0]}},
             "RolloutDataModule": {"next_step": 4}, "atlas": {"rl_step": 3}, RNG_KEY: capture()}
    state.update(change)
    return state


def _state_bytes(**change) -> bytes:
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(resumable_state(**change), buffer)
    return buffer.getvalue()


#: The LoRA settings of the tiny model's runs (``conf/model/tiny.yaml``: r8 alpha 16, all-linear),
#: as peft writes them: what ``_checkpoint``'s adapters say they were trained with.
TINY_LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"]}


def _fake_adapter(target, role, step) -> None:
    """An adapter folder that says it is of ``TINY_LORA`` and holds the tensors ``resumable_state``
    trains (two LoRA factors of shape (2,) with ``step``'s values, the critic's value head)."""
    import torch
    from safetensors.torch import save_file

    target.mkdir(parents=True)
    (target / "adapter_config.json").write_text(json.dumps({**TINY_LORA, "role": role}))
    save_file({f"m.{factor}.weight": torch.full((2,), float(step)) for factor in ("lora_A", "lora_B")},
              target / "adapter_model.safetensors")
    if role == "critic":
        save_file({"weight": torch.zeros(2)}, target / "value_head.safetensors")


def _trained_state(model) -> dict:
    """The ``state_dict`` and optimizer states a run of ``model`` (an ``ActorCritic``) saves: its
    trainable tensors, and Adam's moments for each of the actor's and the critic's parameters."""
    import torch

    def adam(params, lr):
        return {"state": {i: {"step": torch.tensor(3.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
                          for i, p in enumerate(params)}, "param_groups": [{"params": list(range(len(params))), "lr": lr}]}

    trained = {f"model.{name}": p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    return {"state_dict": trained,
            "optimizer_states": [adam(list(model.actor_parameters()), TINY_LR["actor"]),
                                 adam(list(model.critic_parameters()), TINY_LR["critic"])]}


def _checkpoint(root, step, *, adapters=None, state=None):
    """``root/global_step_<step>`` as the checkpoint callback lays it out, marker last; its
    adapters are of ``TINY_LORA`` (``_fake_adapter``: tensors that fit ``resumable_state``, not the tiny model)."""
    folder = root / f"global_step_{step}"
    for role in ("actor", "critic"):
        target = folder / role / "lora_adapter"
        if adapters is not None:
            from atlas_lightning.models.adapters import save_adapter

            save_adapter(adapters, role, target)
        else:
            _fake_adapter(target, role, step)
    (folder / "lightning").mkdir(parents=True)
    if state is None:  # the state of this step (its RL step, the cursor at the next)
        steps = {"atlas": {"rl_step": step}, "RolloutDataModule": {"next_step": step + 1}}
        state = _state_bytes(**steps, **(_trained_state(adapters) if adapters is not None else {}))
    (folder / "lightning" / "state.ckpt").write_bytes(state)
    (folder / "val_dumps").mkdir()
    (folder / "val_dumps" / f"{step}.jsonl").write_text("{}\n")  # validation's, not the checkpoint's
    write_marker(folder, step)
    return folder


def test_checkpoint_step_parses_only_global_step_folders(tmp_path):
    assert checkpoint_step(tmp_path / "global_step_29") == 29
    assert checkpoint_step("runs/x/global_step_0") == 0
    for name in ("global_step_", "global_step_x", "global_step_3a", ".tmp-global_step_3", "step_3"):
        assert checkpoint_step(tmp_path / name) is None, name


def test_an_intact_checkpoint_verifies(tmp_path):
    folder = _checkpoint(tmp_path, 3)
    marker = verify_checkpoint(folder)
    assert marker["global_step"] == 3
    assert sorted(marker["files"]) == ["actor/lora_adapter/adapter_config.json",
                                       "actor/lora_adapter/adapter_model.safetensors",
                                       "critic/lora_adapter/adapter_config.json",
                                       "critic/lora_adapter/adapter_model.safetensors",
                                       "critic/lora_adapter/value_head.safetensors", "lightning/state.ckpt"]


@pytest.mark.parametrize("damage, message", [
    ("no_marker", "no checkpoint.json (not a complete checkpoint"),
    ("marker_garbage", "checkpoint.json is not readable JSON"),
    ("marker_no_files", "checkpoint.json is damaged"),
    ("marker_other_step", "checkpoint.json says global_step=4, the folder is step 3"),
    ("state_missing", "lightning/state.ckpt is missing (checkpoint.json lists it)"),
    ("state_truncated", "lightning/state.ckpt has 100 bytes, checkpoint.json says 1024 (truncated or replaced)"),
    ("state_flipped", "lightning/state.ckpt does not match its sha256 in checkpoint.json (damaged)"),
    ("adapter_flipped", "critic/lora_adapter/adapter_model.safetensors does not match its sha256"),
    ("extra_file", "actor/lora_adapter/stray.bin is not listed in checkpoint.json"),
    ("marker_escapes", "checkpoint.json lists '../../outside', which is not a path inside the folder"),
])
def test_damage_is_refused_naming_folder_and_file(tmp_path, damage, message):
    folder = _checkpoint(tmp_path, 3, state=b"lightning state " * 64)  # bytes alone: the marker's check
    marker = json.loads((folder / MARKER).read_text())
    state = folder / "lightning" / "state.ckpt"
    if damage == "no_marker":
        (folder / MARKER).unlink()
    elif damage == "marker_garbage":
        (folder / MARKER).write_text("{\"global_step\": 3, \"files\": {")
    elif damage == "marker_no_files":
        (folder / MARKER).write_text(json.dumps({"global_step": 3, "files": {"x": 1}}))
    elif damage == "marker_other_step":
        (folder / MARKER).write_text(json.dumps({**marker, "global_step": 4}))
    elif damage == "state_missing":
        state.unlink()
    elif damage == "state_truncated":
        state.write_bytes(state.read_bytes()[:100])
    elif damage == "state_flipped":
        data = bytearray(state.read_bytes())
        data[500] ^= 1
        state.write_bytes(bytes(data))
    elif damage == "adapter_flipped":
        path = folder / "critic" / "lora_adapter" / "adapter_model.safetensors"
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x80
        path.write_bytes(bytes(data))
    elif damage == "marker_escapes":
        marker["files"]["../../outside"] = {"bytes": 1, "sha256": "0" * 64}
        (folder / MARKER).write_text(json.dumps(marker))
    else:
        (folder / "actor" / "lora_adapter" / "stray.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError) as info:
        verify_checkpoint(folder)
    assert str(info.value).startswith(f"{folder}: ") and message in str(info.value)


def test_sizes_alone_miss_a_flipped_byte_that_hashes_catch(tmp_path):
    folder = _checkpoint(tmp_path, 3)
    state = folder / "lightning" / "state.ckpt"
    data = bytearray(state.read_bytes())
    data[0] ^= 1
    state.write_bytes(bytes(data))
    verify_checkpoint(folder, hashes=False)
    with pytest.raises(CheckpointError, match="sha256"):
        verify_checkpoint(folder)


def test_latest_verified_skips_damaged_and_unfinished_folders(tmp_path):
    for step in (2, 4, 6):
        _checkpoint(tmp_path, step)
    (tmp_path / "global_step_6" / "lightning" / "state.ckpt").write_bytes(b"short")
    (tmp_path / "global_step_8" / "val_dumps").mkdir(parents=True)  # validation only, no marker
    folder, refusals = latest_verified(tmp_path)
    assert folder == tmp_path / "global_step_4"
    assert len(refusals) == 1 and "global_step_6: lightning/state.ckpt has 5 bytes" in refusals[0]
    assert latest_verified(tmp_path, before_step=4) == (tmp_path / "global_step_2", [])


# -- the run's starting point ----------------------------------------------------------------------


def _model_folder(tmp_path):
    return write_fake_model_folder(tmp_path / "model")


def test_resume_auto_falls_back_to_the_newest_checkpoint_that_verifies_and_says_so(tmp_path, cfg_of):
    from atlas_lightning.run.facts import check_inputs

    checkpoints = tmp_path / "checkpoints" / "run"
    for step in (5, 10):
        _checkpoint(checkpoints, step)
    (checkpoints / "global_step_10" / "lightning" / "state.ckpt").unlink()
    start = check_inputs(cfg_of("trainer.resume=auto")).start
    assert start.resume == checkpoints / "global_step_5"
    assert start.state == str(checkpoints / "global_step_5" / "lightning" / "state.ckpt")
    assert start.notes[0].startswith(f"trainer.resume=auto: skipped {checkpoints / 'global_step_10'}: "
                                     f"lightning/state.ckpt is missing")
    assert start.notes[-1] == f"trainer.resume=auto: resuming from {checkpoints / 'global_step_5'} (verified)"


def test_resume_auto_refuses_when_no_checkpoint_verifies(tmp_path, cfg_of):
    from atlas_lightning.run.facts import check_inputs

    checkpoints = tmp_path / "checkpoints" / "run"
    (_checkpoint(checkpoints, 5) / "lightning" / "state.ckpt").write_bytes(b"")
    with pytest.raises(ConfigError, match="trainer.resume=auto: no checkpoint of this run verifies"):
        check_inputs(cfg_of("trainer.resume=auto"))
    assert check_inputs(cfg_of("name=other", "trainer.resume=auto")).start.resume is None  # nothing to resume


def test_a_resume_beyond_total_steps_is_refused_and_one_below_it_trains_on(tmp_path, cfg_of):
    """A checkpoint past ``trainer.total_steps`` would start a run that trains nothing; one of its
    run's last step resumed with more steps trains on: Lightning's record that the epoch's last
    batch was seen is cleared when the step is below the new total."""
    from types import SimpleNamespace

    from atlas_lightning.ppo.module import PPOModule
    from atlas_lightning.run.facts import check_inputs

    checkpoints = tmp_path / "checkpoints" / "run"
    folder = _checkpoint(checkpoints, 5)
    for resume in ("auto", str(folder)):
        with pytest.raises(ConfigError, match=rf"trainer.resume={resume}: {folder} is step 5, beyond "
                                              rf"trainer.total_steps=3: nothing would be trained"):
            check_inputs(cfg_of(f"trainer.resume={resume}", "trainer.total_steps=3"))
    assert check_inputs(cfg_of("trainer.resume=auto", "trainer.total_steps=5")).start.resume == folder

    for total, last in ((5, True), (6, False)):
        loops = {"fit_loop": {"epoch_loop.batch_progress": {"is_last_batch": True}}}
        module = SimpleNamespace(cfg=cfg_of(f"trainer.total_steps={total}"), skipped_optimizer_steps={},
                                 weight_sync=SimpleNamespace(load_state_dict=lambda state: None))
        PPOModule.on_load_checkpoint(module, {"atlas": {"rl_step": 5}, "loops": loops})
        assert loops["fit_loop"]["epoch_loop.batch_progress"]["is_last_batch"] is last


def test_an_explicit_resume_or_init_from_must_verify(tmp_path, cfg_of):
    from atlas_lightning.run.facts import check_inputs

    folder = _checkpoint(tmp_path / "elsewhere", 7)
    (folder / "actor" / "lora_adapter" / "adapter_model.safetensors").write_bytes(b"\0" * 10)
    with pytest.raises(ConfigError, match=rf"trainer.resume={folder}: {folder}: actor/lora_adapter/adapter_model"):
        check_inputs(cfg_of(f"trainer.resume={folder}"))
    with pytest.raises(ConfigError, match=rf"trainer.init_from={folder}: .*actor/lora_adapter/adapter_model"):
        check_inputs(cfg_of(f"trainer.init_from={folder}"))


def test_init_from_needs_a_complete_checkpoint_as_resume_does(tmp_path, cfg_of):
    from atlas_lightning.run.facts import check_inputs

    folder = _checkpoint(tmp_path / "elsewhere", 7)
    (folder / MARKER).unlink()
    with pytest.raises(ConfigError, match=r"trainer.init_from=.*no checkpoint.json \(not a complete checkpoint"):
        check_inputs(cfg_of(f"trainer.init_from={folder}"))


def test_init_from_with_the_actor_alone_checks_the_actor_alone(tmp_path, cfg_of, tiny_model_dir):
    """Real adapters (the start-up reads a starting adapter's tensors); the critic's then damaged
    after the marker was written."""
    from atlas_lightning.run.facts import check_inputs
    from tests.model_builds import actor_critic

    folder = _checkpoint(tmp_path / "elsewhere", 7, adapters=actor_critic(tiny_model_dir, {"rank": 8, "alpha": 16}))
    (folder / "critic" / "lora_adapter" / "adapter_model.safetensors").write_bytes(b"\0")
    with pytest.raises(ConfigError, match="critic/lora_adapter"):
        check_inputs(cfg_of(f"trainer.init_from={folder}"))
    check_inputs(cfg_of(f"trainer.init_from={folder}", "trainer.init_critic=false"))


def _half_moments(state):
    kept = state["optimizer_states"][0]
    kept["state"] = {0: kept["state"][0]}  # the actor's second parameter lost its moments
    return state


_PARTIAL = [
    ("no_critic_optimizer", lambda s: {**s, "optimizer_states": s["optimizer_states"][:1]},
     "holds 1 optimizer state(s), a resume needs 2 (actor, critic)"),
    ("half_actor_moments", _half_moments, "the actor optimizer keeps Adam's moments for 1 of its 2 parameters"),
    ("empty_critic", lambda s: {**s, "optimizer_states": [s["optimizer_states"][0],
                                                          {**s["optimizer_states"][1], "state": {}}]},
     "the critic optimizer has no state after RL step 3"),
    ("no_cursor", lambda s: {k: v for k, v in s.items() if k != "RolloutDataModule"}, "no data cursor"),
    ("no_loops", lambda s: {k: v for k, v in s.items() if k != "loops"}, "no 'loops' entry"),
    ("no_rng", lambda s: {k: v for k, v in s.items() if k != "rng_states"},
     "holds no random generator states (written before they were kept)"),
    ("rng_without_ranks", lambda s: {**s, "rng_states": {"world_size": 1, "ranks": []}},
     "holds no random generator states"),
    ("rng_without_numpy", lambda s: {**s, "rng_states": {"world_size": 1, "ranks": [
        {k: v for k, v in s["rng_states"]["ranks"][0].items() if k != "numpy"}]}},
     "the random generator states of rank(s) [0] lack some of torch, numpy, python"),
    ("cursor_not_a_step", lambda s: {**s, "RolloutDataModule": {"next_step": "x"}},
     "records RL step 3 and data cursor 'x': not step numbers"),
    ("another_steps_state", lambda s: {**s, "atlas": {"rl_step": 7}},
     "records RL step 7, its folder is global_step_3: the state is another step's"),
]


def _without(state, key):
    return {k: v for k, v in state.items() if k != key}


def _set(mapping, key, value):
    return {**mapping, key: value}


def _optimizer(state, index, change):
    optimizers = list(state["optimizer_states"])
    optimizers[index] = change(optimizers[index])
    return {**state, "optimizer_states": optimizers}


def _moments(entry, moment, value):
    return {**entry, "state": {i: {**kept, moment: value} for i, kept in entry["state"].items()}}


def _kept(entry, param, name, value):
    """``entry`` (an optimizer's state) with ``name`` of parameter ``param`` alone set to ``value``."""
    return {**entry, "state": {**entry["state"], param: {**entry["state"][param], name: value}}}


#: The trainable tensors and moments against the checkpoint's adapters (``run/resume_tensors.py``).
_TENSORS = [
    ("no_state_dict", lambda s: _without(s, "state_dict"), "has no trainable tensors (state_dict)"),
    ("an_empty_state_dict", lambda s: {**s, "state_dict": {}}, "has no trainable tensors (state_dict)"),
    ("a_tensor_left_out", lambda s: {**s, "state_dict": _without(s["state_dict"], "m.lora_B.actor.weight")},
     "its Lightning state's actor tensors do not match its actor/lora_adapter: 1 missing (shapes [2] x1)"),
    ("a_tensor_of_another_shape", lambda s: {**s, "state_dict": _set(s["state_dict"], "m.lora_A.critic.weight",
                                                                     torch.zeros(3))},
     "its Lightning state's critic tensors do not match its critic/lora_adapter: 1 missing"),
    ("a_tensor_no_adapter_has", lambda s: {**s, "state_dict": _set(s["state_dict"], "m.other.weight", torch.zeros(2))},
     "holds 1 tensor(s) neither adapter has (m.other.weight)"),
    ("a_nan_tensor", lambda s: {**s, "state_dict": _set(s["state_dict"], "m.lora_A.actor.weight",
                                                        torch.full((2,), float("nan")))},
     "its Lightning state's trainable tensor m.lora_A.actor.weight holds 2 NaN or inf value(s) of 2: resume from "
     "an earlier checkpoint"),
    ("one_inf_value", lambda s: {**s, "state_dict": _set(s["state_dict"], "m.lora_B.critic.weight",
                                                         torch.tensor([0.0, float("inf")]))},
     "its Lightning state's trainable tensor m.lora_B.critic.weight holds 1 NaN or inf value(s) of 2"),
    ("a_nan_value_head", lambda s: {**s, "state_dict": _set(s["state_dict"], "m.value_head.weight",
                                                            torch.tensor([float("nan"), 0.0]))},
     "its Lightning state's trainable tensor m.value_head.weight holds 1 NaN or inf value(s) of 2"),
    ("an_optimizer_of_fewer_parameters", lambda s: _optimizer(s, 1, lambda e: {
        "state": {i: v for i, v in e["state"].items() if i < 2}, "param_groups": [{**e["param_groups"][0], "params": [0, 1]}]}),
     "the critic optimizer lists 2 parameters, its adapter trains 3"),
    ("moments_of_another_shape", lambda s: _optimizer(s, 0, lambda e: _moments(e, "exp_avg", torch.zeros(5))),
     "the actor optimizer's exp_avg tensors have other shapes than the actor adapter's tensors"),
    ("nan_moments", lambda s: _optimizer(s, 1, lambda e: _moments(e, "exp_avg_sq", torch.full((2,), float("inf")))),
     "the critic optimizer's exp_avg_sq holds 2 NaN or inf value(s) of 2 (parameter "),
    ("one_actor_moment_not_finite", lambda s: _optimizer(s, 0, lambda e: _kept(e, 1, "exp_avg",
                                                                              torch.tensor([float("-inf"), 0.0]))),
     "the actor optimizer's exp_avg holds 1 NaN or inf value(s) of 2 (parameter "),
    ("a_nan_step", lambda s: _optimizer(s, 1, lambda e: _kept(e, 2, "step", torch.tensor(float("nan")))),
     "the critic optimizer's step holds 1 NaN or inf value(s) of 1 (parameter "),
]


@pytest.mark.parametrize("distributed", [False, True], ids=["one_file", "distributed"])
@pytest.mark.parametrize("damage, change, message", _TENSORS, ids=[d for d, _, _ in _TENSORS])
def test_a_resume_whose_tensors_do_not_fit_its_adapters_is_refused_before_anything_is_written(
        tmp_path, cfg_of, damage, change, message, distributed):
    """The whole class: whatever the state lacks, holds beside, or holds of another shape or not
    finite (any trainable tensor, any of either optimizer's per-parameter state), measured against
    the checkpoint's own adapters, is named before the run writes (a distributed state's shapes
    from its metadata, its values read through torch.distributed.checkpoint)."""

    if distributed and damage == "no_state_dict":
        pytest.skip("Lightning writes a distributed state_dict always (an_empty_state_dict tries it)")
    _refused_once_changed(tmp_path, cfg_of, change, message, distributed)


def restoring(distributed: bool) -> tuple[str, ...]:
    """Overrides of a run that restores a state of that layout (``run/resume_state._check_layout``):
    a torch.distributed one under FSDP2 (two CPU processes), one file in one CPU process."""
    return ("trainer.devices=2", "layout.gpus=2", "layout.train_gpus=2") if distributed else ()


@pytest.mark.parametrize("distributed", [False, True], ids=["one_file", "distributed"])
def test_the_whole_resumable_state_is_accepted(tmp_path, cfg_of, distributed):
    """The control of the refusals below: ``resumable_state`` unchanged, in either layout, resumes
    in a run that restores that layout. Each refusal then comes from its own change alone."""
    from atlas_lightning.run.facts import check_inputs

    folder = _checkpoint(tmp_path / "elsewhere", 3)
    _write_state(folder, resumable_state(), distributed)
    assert check_inputs(cfg_of(f"trainer.resume={folder}", *restoring(distributed))).start.resume == folder


def _refused_once_changed(tmp_path, cfg_of, change, message: str, distributed: bool) -> None:
    """``change`` of a resumable state (accepted whole: the test above) is refused with ``message``."""
    from atlas_lightning.run.facts import check_inputs

    folder = _checkpoint(tmp_path / "elsewhere", 3)
    _write_state(folder, change(resumable_state()), distributed)
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_inputs(cfg_of(f"trainer.resume={folder}", *restoring(distributed)))


def _write_state(folder, state, distributed: bool) -> None:
    """``folder/lightning`` as one file, or as Lightning writes a torch.distributed checkpoint
    (tensors and optimizer states by parameter name, the rest in ``meta.pt``); marker rewritten."""
    import shutil

    import torch
    import torch.distributed.checkpoint as dcp

    target = folder / "lightning"
    shutil.rmtree(target)
    target.mkdir()
    if not distributed:
        torch.save(state, target / "state.ckpt")
    else:
        tensors = {"state_dict": state["state_dict"]}
        for index, optimizer in enumerate(state["optimizer_states"]):
            name = {i: f"role{index}.p{i}" for i in optimizer["param_groups"][0]["params"]}
            tensors[f"optimizer_{index}"] = {
                "state": {name[i]: value for i, value in optimizer["state"].items()},
                "param_groups": [{**group, "params": [name[i] for i in group["params"]]}
                                 for group in optimizer["param_groups"]]}
        dcp.save(tensors, checkpoint_id=str(target))
        torch.save({k: v for k, v in state.items() if k not in ("state_dict", "optimizer_states")}, target / "meta.pt")
    (folder / MARKER).unlink()
    write_marker(folder, checkpoint_step(folder))


@pytest.mark.parametrize("distributed", [False, True], ids=["one_file", "distributed"])
@pytest.mark.parametrize("damage, change, message", _PARTIAL, ids=[d for d, _, _ in _PARTIAL])
def test_a_resume_from_a_partial_state_is_refused_before_anything_is_written(tmp_path, cfg_of, damage, change, message,
                                                                           distributed):

    _refused_once_changed(tmp_path, cfg_of, change, message, distributed)


def test_an_actor_that_has_not_stepped_yet_resumes(tmp_path, cfg_of):
    """During critic warm-up the actor optimizer has no state: a resume is whole without it."""
    from atlas_lightning.run.facts import check_inputs

    state = resumable_state()
    state["optimizer_states"][0]["state"] = {}
    folder = _checkpoint(tmp_path / "elsewhere", 3, state=_state_bytes(optimizer_states=state["optimizer_states"]))
    assert check_inputs(cfg_of(f"trainer.resume={folder}")).start.resume == folder


def test_the_checks_return_what_they_read_once(tmp_path, cfg_of, sample_data_dir, tiny_model_dir):
    """What the checks load is what the run uses: the splits, the starting adapter's LoRA shape
    (its own config's, the critic's from the config), the folders."""
    from atlas_lightning.questions.loader import load_split
    from atlas_lightning.run.facts import check_inputs
    from tests.model_builds import actor_critic

    own = {"rank": 4, "alpha": 8, "target_modules": ["q_proj"]}  # the actor's shape of its own
    folder = _checkpoint(tmp_path / "elsewhere", 7, adapters=actor_critic(tiny_model_dir, own,
                                                                           critic_lora={"rank": 8, "alpha": 16}))
    cfg = cfg_of(f"trainer.init_from={folder}", "trainer.init_critic=false", "data.val_max_questions=3")
    facts = check_inputs(cfg)
    assert facts.folders["checkpoints"] == tmp_path / "checkpoints" / "run"
    assert facts.lora["actor"].rank == 4 and facts.lora["actor"].target_modules == ("q_proj",)
    assert facts.lora["actor"].source == str(folder / "actor" / "lora_adapter" / "adapter_config.json")
    assert facts.lora["critic"].source == "model.lora" and facts.lora["critic"].rank == cfg.model.lora.rank
    assert facts.questions.train == load_split(cfg.data, "train")
    assert len(facts.questions.val) == 3 * len(cfg.data.benchmarks)
    assert check_inputs(cfg, data=False).questions is None


def test_a_starting_adapter_without_a_lora_shape_is_refused_before_anything_is_written(tmp_path, cfg_of):
    from atlas_lightning.errors import InputError
    from atlas_lightning.run.facts import check_inputs

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 4}))
    with pytest.raises(InputError, match=rf"^model.actor_adapter={adapter}: .*field lora_alpha=None is not a positive "
                                         r"number"):
        check_inputs(cfg_of(f"model.actor_adapter={adapter}"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # nothing written


# -- resuming this run's model from a checkpoint of another ---------------------------------------


@pytest.fixture(scope="module")
def trained_checkpoint(qwen3_base, tmp_path_factory):
    from tests.model_builds import actor_critic
    from tests.conftest import randomize_adapters

    model = actor_critic(qwen3_base, {"rank": 4, "alpha": 8})
    randomize_adapters(model)
    return _checkpoint(tmp_path_factory.mktemp("ckpt"), 3, adapters=model)


def _module(tmp_path, base, checkpoint, *overrides):
    from atlas_lightning.ppo.module import PPOModule

    cfg = compose(["experiment=tiny-cpu", f"paths.root={tmp_path}", f"model.path={base}", "model.lora.rank=4",
                   "model.lora.alpha=8", "model.logprob_chunk_tokens=4", *overrides])
    return PPOModule(cfg, resume_from=checkpoint)


def test_resume_onto_another_base_of_the_same_shapes_is_refused(trained_checkpoint, tmp_path):
    from atlas_lightning.demo.tiny_causal_lm import save_tiny_causal_lm

    sibling = save_tiny_causal_lm(tmp_path / "sibling", seed=5)  # same architecture and shapes, other weights
    module = _module(tmp_path, sibling, trained_checkpoint)
    with pytest.raises(ConfigError, match=rf"trainer.resume={trained_checkpoint}: .*fingerprint: .*same shapes, "
                                          r"different weights"):
        module.configure_model()


def test_resume_with_other_target_modules_is_refused_naming_the_key(trained_checkpoint, qwen3_base, tmp_path):
    module = _module(tmp_path, qwen3_base, trained_checkpoint, "model.lora.target_modules=[q_proj,v_proj]")
    with pytest.raises(ConfigError) as info:
        module.configure_model()
    message = str(info.value)
    assert message.startswith(f"trainer.resume={trained_checkpoint}: ")
    assert "target_modules differ from this run's model.lora.target_modules" in message


def test_resume_onto_the_same_base_and_settings_passes(trained_checkpoint, qwen3_base, tmp_path):
    module = _module(tmp_path, qwen3_base, trained_checkpoint)
    module.configure_model()
    assert module.model is not None


def _groups_with(state, **fields):
    """``state`` whose optimizers' groups also say ``fields`` (as AdamW saves them)."""
    return {**state, "optimizer_states": [{**entry, "param_groups": [{**group, **fields} for group in entry["param_groups"]]}
                                          for entry in state["optimizer_states"]]}


@pytest.mark.parametrize("distributed", [False, True], ids=["one_file", "distributed"])
@pytest.mark.parametrize("override, message", [
    ("algorithm.actor_lr=0.5", "its actor optimizer was set up with lr=0.002 (this run: algorithm.actor_lr=0.5)"),
    ("algorithm.critic_lr=1e-6", "its critic optimizer was set up with lr=0.001 (this run: algorithm.critic_lr=1e-06)"),
    ("algorithm.weight_decay=0.3", "its actor optimizer was set up with weight_decay=0.01 (this run: "
                                   "algorithm.weight_decay=0.3)"),
    ("algorithm.betas=[0.8,0.99]", "its actor optimizer was set up with betas=[0.9, 0.999] (this run: "
                                   "algorithm.betas=[0.8, 0.99])"),
])
def test_a_resume_under_other_optimizer_settings_is_refused_before_anything_is_written(tmp_path, cfg_of, override,
                                                                                      message, distributed):
    """Lightning restores the optimizers' saved settings with their moments: a learning rate (or
    weight decay, betas) changed for the resume would be recorded in the run's config and not used."""
    from atlas_lightning.run.facts import check_inputs

    folder = _checkpoint(tmp_path / "elsewhere", 3)
    _write_state(folder, _groups_with(resumable_state(), weight_decay=0.01, betas=(0.9, 0.999)), distributed)
    check_inputs(cfg_of(f"trainer.resume={folder}", *restoring(distributed)))  # the same settings: accepted
    with pytest.raises(ConfigError, match=re.escape(message)) as refused:
        check_inputs(cfg_of(f"trainer.resume={folder}", override, *restoring(distributed)))
    assert f"trainer.init_from={folder} trainer.resume=null" in str(refused.value)


@pytest.mark.parametrize("role, file, message", [
    ("actor", "adapter_model.safetensors", "adapter_model.safetensors tensor m.lora_A.weight holds 2 non-finite value(s)"),
    ("critic", "adapter_model.safetensors", "adapter_model.safetensors tensor m.lora_A.weight holds 2 non-finite"),
    ("critic", "value_head.safetensors", "value_head.safetensors tensor weight holds 2 non-finite value(s)"),
])
def test_a_resume_whose_adapter_is_not_finite_is_refused_before_anything_is_written(tmp_path, cfg_of, role, file,
                                                                                    message):
    """Its adapters are read as the build reads them, at the start (the marker written after the
    damage: a checkpoint written so, not one damaged since)."""
    from safetensors.torch import load_file, save_file

    from atlas_lightning.run.facts import check_inputs

    folder = _checkpoint(tmp_path / "elsewhere", 3)
    path = folder / role / "lora_adapter" / file
    tensors = load_file(path)
    name = sorted(tensors)[0]
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, path)
    (folder / MARKER).unlink()
    write_marker(folder, 3)
    with pytest.raises(ConfigError, match=re.escape(message)) as refused:
        check_inputs(cfg_of(f"trainer.resume={folder}"))
    assert str(refused.value).startswith(f"trainer.resume={folder}: ")
