"""What a launch would refuse once the model, the data module or the reward is built is refused
at the start, before the run's ``config.yaml`` and logs are written: a checkpoint whose adapters
were trained with other LoRA settings than this run's, or on a base of other config fields
(``run/resume_adapters.py``); questions none of whose prompts fit, or too few to fill a batch
(``rollout/step_questions.fitted_splits``); a reward that cannot be built. A refused launch
leaves the run's folder as it was."""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from atlas_lightning.cli import main
from atlas_lightning.config import ConfigError
from atlas_lightning.store.checkpoints import MARKER, write_marker
from tests.store.test_checkpoint_verification import _checkpoint
from tests.e2e_variants import first_variant_in_make_test


def _tree(root) -> dict[str, str]:
    return {str(p.relative_to(root)): "folder" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("override, role, differs", [
    ("model.lora.rank=16", "actor", "r=8 (this run: 16)"),
    ("model.lora.alpha=32", "actor", "lora_alpha=16.0 (this run: 32.0)"),
    ("model.lora.target_modules=[q_proj,v_proj]", "actor", "target_modules=('down_proj', 'gate_proj', 'k_proj', "
                                                           "'o_proj', 'q_proj', 'up_proj', 'v_proj') (this run: "
                                                           "('q_proj', 'v_proj'))"),
    ("model.critic_lora.rank=4", "critic", "r=8 (this run: 4)"),
])
@pytest.mark.parametrize("training", [True, False], ids=["fit", "validate"])
def test_a_checkpoint_of_other_lora_settings_is_refused_before_anything_is_written(tmp_path, cfg_of, override, role,
                                                                                  differs, training):
    from atlas_lightning.run.facts import check_inputs

    folder = _checkpoint(tmp_path / "elsewhere", 3)
    assert check_inputs(cfg_of(f"trainer.resume={folder}"), training=training).start.resume == folder
    with pytest.raises(ConfigError) as refused:
        check_inputs(cfg_of(f"trainer.resume={folder}", override), training=training)
    message = str(refused.value)
    assert message.startswith(f"trainer.resume={folder}: its {role} adapter ({folder / role / 'lora_adapter'}) "
                              f"was trained with {differs}"), message
    assert f"trainer.init_from={folder}" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere"]


@pytest.mark.parametrize("identity, message", [
    ({"config": {"hidden_size": 64}}, "was trained on a different base: hidden_size is 64 there, 128 in model.path's"),
    ("not json", "atlas_base.json is not readable JSON"),
])
def test_a_checkpoint_of_another_base_is_refused_before_anything_is_written(tmp_path, cfg_of, identity, message):
    from atlas_lightning.run.facts import check_inputs

    folder = _checkpoint(tmp_path / "elsewhere", 3)
    adapter = folder / "critic" / "lora_adapter"
    (adapter / "atlas_base.json").write_text(identity if isinstance(identity, str) else json.dumps(identity))
    (folder / MARKER).unlink()
    write_marker(folder, 3)
    with pytest.raises(ConfigError) as refused:
        check_inputs(cfg_of(f"trainer.resume={folder}"))
    assert str(refused.value).startswith(f"trainer.resume={folder}: {adapter}") and message in str(refused.value)


def test_adapters_as_peft_saves_them_pass_and_are_refused_as_the_built_model_would(tmp_path, cfg_of, tiny_model_dir):
    """The settings compared are the ones the built model compares (``PPOModule._check_resume``):
    real adapters of this run's LoRA resume; the same with another rank is refused at the start."""
    from atlas_lightning.run.facts import check_inputs
    from tests.model_builds import actor_critic

    folder = _checkpoint(tmp_path / "elsewhere", 3, adapters=actor_critic(tiny_model_dir, {"rank": 8, "alpha": 16}))
    assert check_inputs(cfg_of(f"trainer.resume={folder}")).start.resume == folder
    with pytest.raises(ConfigError, match=r"its actor adapter .* was trained with r=8 \(this run: 4\)"):
        check_inputs(cfg_of(f"trainer.resume={folder}", "model.lora.rank=4"))


def _launch(cfg_of, tmp_path, sample_data_dir, tiny_model_dir, *overrides) -> list[str]:
    return ["fit", "experiment=tiny-cpu", f"paths.root={tmp_path}", "name=run", f"model.path={tiny_model_dir}",
            f"data.root={sample_data_dir}", "logger.mode=disabled", *overrides]


def test_a_refused_resume_through_the_cli_exits_2_in_one_line_and_changes_no_file(tmp_path, cfg_of, sample_data_dir,
                                                                                   tiny_model_dir, capsys):
    """A run's folder as its launch left it (config, logs, a checkpoint), resumed with another
    ``model.lora.rank``: refused naming the key and the setting, every file as it was."""
    import logging

    from atlas_lightning.run.wiring import prepare_run

    names = ("atlas_lightning", "lightning", "lightning.pytorch")
    before_handlers = {name: list(logging.getLogger(name).handlers) for name in names}
    prepare_run(cfg_of(), "fit")  # the launch that wrote the checkpoint
    for name in names:  # its log handlers closed, as at that launch's exit
        for handler in [h for h in logging.getLogger(name).handlers if h not in before_handlers[name]]:
            logging.getLogger(name).removeHandler(handler)
            handler.close()
    _checkpoint(tmp_path / "checkpoints" / "run", 3)
    capsys.readouterr()
    before = _tree(tmp_path)
    assert main(_launch(cfg_of, tmp_path, sample_data_dir, tiny_model_dir, "trainer.resume=auto",
                        "model.lora.rank=16")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("atlas-lightning fit: config error: trainer.resume=auto: its actor "
                                               "adapter"), err
    assert _tree(tmp_path) == before


def test_a_reward_that_cannot_be_built_exits_2_before_anything_is_written(tmp_path, cfg_of, sample_data_dir,
                                                                          tiny_model_dir, capsys):
    assert main(_launch(cfg_of, tmp_path, sample_data_dir, tiny_model_dir, "+reward.no_such_argument=1")) == 2
    assert "reward._target_=atlas_lightning.reward.CostReward: cannot build the reward scorer" in capsys.readouterr().err
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "logs").exists()


@pytest.mark.parametrize("overrides, message", [
    (["rollout.max_prompt_length=100"], "config error: rollout.max_prompt_length=100: no train question's prompt fits"),
    (["algorithm.train_batch_size=512"], "config error: algorithm.train_batch_size=512: the 320 training questions "
                                         "whose prompts fit rollout.max_prompt_length cannot fill one batch"),
])
def test_questions_that_cannot_make_a_step_exit_2_before_anything_is_written(tmp_path, cfg_of, sample_data_dir,
                                                                             tiny_model_dir, capsys, overrides,
                                                                             message):
    assert main(_launch(cfg_of, tmp_path, sample_data_dir, tiny_model_dir, *overrides)) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "logs").exists()


@pytest.mark.parametrize("override, message", [
    ("rollout.n=1000000", "rollout.n=1000000: a training step samples 16,000,000 trajectories (16 questions x "
                          "1000000) at once; their prompts alone ("),
    ("rollout.val_n=1000000", "rollout.val_n=1000000: a validation samples 96,000,000 trajectories (96 questions x "
                              "1000000) at once; their prompts alone ("),
])
def test_samples_a_step_cannot_hold_exit_2_before_anything_is_written(tmp_path, cfg_of, sample_data_dir,
                                                                     tiny_model_dir, capsys, monkeypatch, override,
                                                                     message):
    """A ``rollout.n`` (or ``rollout.val_n``) whose step's prompts alone exceed this machine's
    memory (64 GiB here, whatever the machine) is refused naming the key, the floor and the largest
    value that fits it, before anything is written (the machine would kill the run at its first step)."""
    from atlas_lightning.rollout import step_questions

    monkeypatch.setattr(step_questions, "host_memory_bytes", lambda: 64 * 2**30)
    assert main(_launch(cfg_of, tmp_path, sample_data_dir, tiny_model_dir, override)) == 2
    err = capsys.readouterr().err
    key = override.split("=")[0]
    assert message in err and "more than this machine's 64.0 GiB of memory and swap" in err, err
    assert re.search(rf"at most {re.escape(key)}=[\d,]+ fits that floor", err) and "Traceback" not in err
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "logs").exists()


@pytest.mark.parametrize("nodes", [1, 2])
def test_the_step_memory_floor_admits_exactly_what_fits(nodes):
    """``check_step_memory`` at its bound: a step of 16 questions drawing the 16 shortest prompts
    (100 tokens each), 16 bytes a token, on ``nodes`` nodes each of 1000 such steps' memory; a run
    that does not train (``validate``: no training lengths) is held to its validation alone."""
    from omegaconf import OmegaConf

    from atlas_lightning.rollout.step_questions import PROMPT_TOKEN_BYTES, check_step_memory

    def cfg(n, val_n=1):
        return OmegaConf.create({"trainer": {"num_nodes": nodes}, "algorithm": {"train_batch_size": 16},
                                 "rollout": {"n": n, "val_n": val_n}})
    train = [100] * 16 + [5000] * 4  # a step may draw the 16 shortest: they set the floor
    memory = 16 * 100 * PROMPT_TOKEN_BYTES * 1000
    check_step_memory(cfg(1000 * nodes), train, [100], memory)
    with pytest.raises(ConfigError, match=f"^rollout.n={1000 * nodes + 1}: .* at most rollout.n={1000 * nodes:,} fits"):
        check_step_memory(cfg(1000 * nodes + 1), train, [100], memory)
    check_step_memory(cfg(1000 * nodes + 1), None, [100], memory)
    check_step_memory(cfg(1, val_n=16000 * nodes), None, [100], memory)
    with pytest.raises(ConfigError, match=f"^rollout.val_n={16000 * nodes + 1}: .* at most rollout.val_n="
                                          f"{16000 * nodes:,} fits"):
        check_step_memory(cfg(1, val_n=16000 * nodes + 1), None, [100], memory)


def test_the_questions_are_fitted_once_at_the_start_and_the_skipped_ones_reach_the_log(cfg_of):
    """The start-up fits the splits (saying how many it skipped, for the run's log) and the data
    module samples from what it fitted."""
    from atlas_lightning.rollout.datamodule import RolloutDataModule
    from atlas_lightning.run.facts import check_inputs

    cfg = cfg_of("rollout.max_prompt_length=614")
    facts = check_inputs(cfg)
    skipped = 320 - len(facts.questions.train)
    assert 0 < skipped < 320
    assert f"{skipped} of 320 train questions have prompts over rollout.max_prompt_length=614 and are skipped" in (
        facts.notes)
    dm = RolloutDataModule(cfg, engine=object(), questions=facts.questions)
    dm.setup()
    assert dm.train_questions is facts.questions.train and dm.val_questions is facts.questions.val


@pytest.mark.parametrize("resume", ["null", "auto"])
@pytest.mark.parametrize("entry", ["global_step_1", "global_step_12"])
def test_a_file_where_a_step_checkpoint_goes_is_refused_before_anything_is_written(tmp_path, cfg_of, resume, entry):
    """A fresh run would stop when it saves that step, and ``auto`` would pass over it."""
    from atlas_lightning.run.facts import check_inputs

    checkpoints = tmp_path / "checkpoints" / "run"
    checkpoints.mkdir(parents=True)
    (checkpoints / entry).write_text("not a checkpoint")
    with pytest.raises(ConfigError, match=re.escape(f"holds {checkpoints / entry}, which is not a folder")):
        check_inputs(cfg_of(f"trainer.resume={resume}"))
    assert sorted(p.name for p in checkpoints.iterdir()) == [entry]


@pytest.mark.parametrize("start", first_variant_in_make_test(
    ["model.actor_adapter", "model.critic_adapter", "trainer.init_from", "trainer.resume"]))
def test_adapters_of_a_base_of_the_same_shapes_and_other_weights_are_refused_before_anything_is_written(
        tmp_path, cfg_of, tiny_model_dir, start):
    """The weights' fingerprint (``models/identity.py``) is read from the base folder at the start,
    not only once the model is built (after the run's config and logs are written)."""
    from atlas_lightning.demo.tiny_model import build_tiny_model
    from atlas_lightning.run.facts import check_inputs
    from tests.model_builds import actor_critic

    folder = _checkpoint(tmp_path / "elsewhere", 3, adapters=actor_critic(tiny_model_dir, {"rank": 8, "alpha": 16}))
    other = tmp_path / "other-base"
    build_tiny_model(other, seed=1)  # the tiny model's shapes, other weights
    named = {"model.actor_adapter": folder / "actor" / "lora_adapter",
             "model.critic_adapter": folder / "critic" / "lora_adapter"}.get(start, folder)
    check_inputs(cfg_of(f"{start}={named}"))  # on its own base: accepted
    with pytest.raises(ConfigError, match=re.escape("was trained on a different base model: model.path=")) as refused:
        check_inputs(cfg_of(f"{start}={named}", f"model.path={other}"))
    assert str(refused.value).startswith(start) and str(named) in str(refused.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "other-base"]


@pytest.mark.parametrize("case", ["model_architectures", "adapter_dora", "resume_cursor"])
def test_inputs_that_parse_but_lie_exit_2_in_one_line_before_anything_is_written(tmp_path, cfg_of, sample_data_dir,
                                                                                 tiny_model_dir, capsys, case):
    """One of each class the start-up now refuses (a base folder's file, a starting adapter's
    LoRA variant, a checkpoint's data cursor), through the CLI: exit 2, one line naming the
    key and the file, no traceback, the run's folders not made."""
    import shutil

    from tests.store.test_checkpoint_verification import _state_bytes

    elsewhere = tmp_path / "elsewhere"
    if case == "model_architectures":
        model = elsewhere / "model"
        shutil.copytree(tiny_model_dir, model)
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
        override, named = f"model.path={model}", "config.json's architectures names LlamaForCausalLM"
    elif case == "adapter_dora":
        folder = _checkpoint(elsewhere, 3) / "actor" / "lora_adapter"
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
        override, named = f"model.actor_adapter={folder}", "adapter_config.json: the adapter uses DoRA"
    else:
        folder = _checkpoint(elsewhere, 3, state=_state_bytes(atlas={"rl_step": 3},
                                                               RolloutDataModule={"next_step": 3}))
        override, named = f"trainer.resume={folder}", "data cursor 3 (the next step to train is 4)"
    capsys.readouterr()
    assert main(_launch(cfg_of, tmp_path, sample_data_dir, tiny_model_dir, override)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0] and "Traceback" not in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere"]


def test_preflight_resolves_and_verifies_the_resume_as_fit_does(tmp_path, cfg_of):
    """Pre-flight's ``resume`` line: the checkpoint ``fit`` would resume from, verified, or what
    ``fit`` would refuse, in the same words (a launch that passed pre-flight had then stopped at
    its start on a missing or mismatched checkpoint)."""
    from atlas_lightning.run.facts import check_inputs
    from atlas_lightning.run.preflight import check_resume

    folder = _checkpoint(tmp_path / "elsewhere", 3)
    assert check_resume(cfg_of(f"trainer.resume={folder}")) == f"resuming from {folder} (verified)"
    assert check_resume(cfg_of()) == "a fresh start"
    for resume, override in ((folder, "model.lora.rank=16"), (tmp_path / "missing", "seed=0")):
        with pytest.raises(ConfigError) as by_fit:
            check_inputs(cfg_of(f"trainer.resume={resume}", override))
        with pytest.raises(ConfigError) as by_preflight:
            check_resume(cfg_of(f"trainer.resume={resume}", override))
        assert str(by_preflight.value) == str(by_fit.value)
