"""Checkpoints are verified against their own ``checkpoint.json`` (file list, sizes, sha256)
before a run resumes from or starts from them; ``trainer.resume=auto`` falls back to the newest
one that verifies and says so; a resume onto another base or other LoRA target modules is
refused naming the key and the checkpoint, before Lightning loads anything."""

from __future__ import annotations

import json
import re

import pytest

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


def resumable_state(**change) -> dict:
    """A Lightning state of the shape a resume restores (two AdamW optimizers with their moments,
    loops, callbacks, the data cursor, the module's record, every rank's generator states), with
    ``change`` applied."""
    import torch

    from atlas_lightning.ppo.rng_state import RNG_KEY, capture

    def adam(names):
        return {"state": {i: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)}
                          for i in range(len(names))}, "param_groups": [{"params": list(range(len(names))), "lr": 1e-6}]}

    state = {"state_dict": {"a": torch.zeros(2)}, "optimizer_states": [adam("ab"), adam("cd")],
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


def _checkpoint(root, step, *, adapters=None, state=None):
    """``root/global_step_<step>`` as the checkpoint callback lays it out, marker last; its
    adapters are of ``TINY_LORA`` (the bytes of their tensors are not a safetensors file)."""
    folder = root / f"global_step_{step}"
    for role in ("actor", "critic"):
        target = folder / role / "lora_adapter"
        if adapters is not None:
            from atlas_lightning.models.adapters import save_adapter

            save_adapter(adapters, role, target)
        else:
            target.mkdir(parents=True)
            (target / "adapter_config.json").write_text(json.dumps({**TINY_LORA, "role": role}))
            (target / "adapter_model.safetensors").write_bytes(bytes(range(256)) * (step + 1))
    (folder / "lightning").mkdir(parents=True)
    (folder / "lightning" / "state.ckpt").write_bytes(_state_bytes() if state is None else state)
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
                                       "critic/lora_adapter/adapter_model.safetensors", "lightning/state.ckpt"]


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
]


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
    from atlas_lightning.run.facts import check_inputs

    folder = _checkpoint(tmp_path / "elsewhere", 3)
    _write_state(folder, resumable_state(), distributed)
    check_inputs(cfg_of(f"trainer.resume={folder}"))  # whole: accepted
    _write_state(folder, change(resumable_state()), distributed)
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_inputs(cfg_of(f"trainer.resume={folder}"))


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
    from atlas_lightning.run.facts import check_inputs
    from atlas_lightning.store.lora_shapes import AdapterConfigError

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 4}))
    with pytest.raises(AdapterConfigError, match="field lora_alpha=None is not a positive number"):
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
