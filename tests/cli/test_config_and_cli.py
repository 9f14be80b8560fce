"""The CLI and config composition: every run of README, "The runs of report 28" composes, bad input fails before
any work naming the key, printing the config does no work, user configs and callbacks plug in.
Report 28 is ATLAS report 28, the report this project reproduces."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from atlas_lightning.cli import main
from atlas_lightning.config import ConfigError, compose, config_dir, run_dirs

EXPERIMENTS = sorted(p.stem for p in (Path(config_dir()) / "experiment").glob("*.yaml"))
REPORT_RUNS = {
    "r28-continued-cost-8gpu-n32", "r28-continued-cost-8gpu-t49152-memory", "r28-continued-cost-8gpu-t73728-memory",
    "r28-continued-cost-8gpu-t49152-tp8-memory", "r28-continued-cost-8gpu-t49152-n16-memory",
    "r28-continued-cost-8gpu-t49152-n16-separate4-4-memory", "r28-continued-cost-8gpu-t98304-separate6-2-memory",
    "r28-base-cost-2gpu", "tiny-cpu",
}


def test_every_run_of_the_spec_has_an_experiment_file():
    assert REPORT_RUNS <= set(EXPERIMENTS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_composes_and_is_named_after_its_run(experiment, tmp_path):
    cfg = compose([f"experiment={experiment}", f"paths.root={tmp_path}"])
    assert cfg.name == experiment
    # Only overrides: no experiment file defines a key outside the schema's groups.
    text = (Path(config_dir()) / "experiment" / f"{experiment}.yaml").read_text()
    top = set(yaml.safe_load(text)) - {"defaults"}
    assert top <= set(OmegaConf.to_container(cfg)), top


def test_training_of_record_settings():
    cfg = compose(["experiment=r28-continued-cost-8gpu-n32"])
    assert (cfg.trainer.devices, cfg.layout.engine_tp, cfg.rollout.n) == (8, 4, 32)
    assert (cfg.algorithm.train_batch_size, cfg.algorithm.ppo_mini_batch_size, cfg.algorithm.ppo_epochs) == (32, 8, 2)
    assert (cfg.rollout.max_in_flight, cfg.trainer.val_every, cfg.trainer.total_steps) == (640, 5, 40)
    assert cfg.algorithm.ppo_max_token_len_per_gpu == 49152 and cfg.reward.cost_per_usd == 0.1
    assert (cfg.model.lora.rank, cfg.model.lora.alpha) == (64, 128)


@pytest.mark.parametrize("override, named", [
    ("model.lora.rnak=3", "model.lora.rnak"),
    ("rollout.n=many", "rollout.n"),
    ("rollout.engine=tgi", "rollout.engine"),
    ("algorithm.ppo_mini_batch_size=5", "algorithm.ppo_mini_batch_size"),
    ("algorithm.gamma=1.5", "algorithm.gamma"),
    ("layout.engine_tp=3", "layout.engine_tp"),
    ("experiment=no-such-run", "experiment/no-such-run"),
])
def test_bad_input_fails_naming_the_key(override, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        compose(["experiment=tiny-cpu", override])


@pytest.mark.parametrize("choice", ["experiment=tiny_cpu", "rollout=vllm-cpu", "experiment=./mine.yaml"])
def test_a_group_option_that_is_not_there_lists_the_options_and_the_way_to_add_one(choice):
    with pytest.raises(ConfigError) as refused:
        compose(["experiment=tiny-cpu", choice])
    message = str(refused.value)
    assert "Available options in" in message and "--config-dir DIR" in message
    assert "search path" not in message  # hydra's providers name nothing the user chose


def test_overrides_after_an_option_are_read_as_hydra_reads_them(capsys):
    from atlas_lightning.cli import parse_args
    from atlas_lightning.run.preflight import main as preflight_main

    assert main(["fit", "experiment=tiny-cpu", "--cfg", "job", "name=after", "seed=3"]) == 0
    printed = OmegaConf.create(capsys.readouterr().out)
    assert (printed.name, printed.seed) == ("after", 3)
    args = parse_args(["preflight", "experiment=a", "--cpu-preflight", "name=b", "--card-gib", "139", "seed=1"])
    assert args.overrides == ["experiment=a", "name=b", "seed=1"] and args.card_gib == 139
    assert preflight_main(["experiment=tiny-cpu", "--cpu-preflight", "trainer.totl_steps=3"]) == 2  # reached the config
    assert "trainer.totl_steps" in capsys.readouterr().out
    for argv, named in ((["fit", "experiment=tiny-cpu", "--bogus", "name=x"], "unrecognized arguments: --bogus"),
                        (["data", "sample", "--out", "s", "name=x"], "unrecognized arguments: name=x")):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2 and named in capsys.readouterr().err


def test_column_names_are_mapped_as_the_readme_shows_and_without_the_plus_the_way_is_named():
    assert dict(compose(["experiment=tiny-cpu", "+data.columns={candidates.cost_usd:price_usd}"]).data.columns) == {
        "candidates.cost_usd": "price_usd"}
    with pytest.raises(ConfigError, match=r"is not in struct \(a key the dict does not have yet is added with \+"):
        compose(["experiment=tiny-cpu", "data.columns={candidates.cost_usd:price_usd}"])


def test_a_home_folder_in_a_path_is_expanded_not_made(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = compose(["experiment=tiny-cpu", "paths.root='~/runs'", "model.path='~/models/m'", "trainer.resume=auto"])
    assert cfg.paths.root == str(tmp_path / "runs") and cfg.paths.outputs == str(tmp_path / "runs/outputs/tiny-cpu")
    assert cfg.model.path == str(tmp_path / "models/m") and cfg.trainer.resume == "auto"


def test_cli_reports_config_errors_with_exit_code_2(capsys):
    assert main(["fit", "experiment=tiny-cpu", "trainer.totl_steps=3"]) == 2
    assert "trainer.totl_steps" in capsys.readouterr().err


def test_print_config_prints_the_composed_config_and_does_no_work(capsys, tmp_path):
    assert main(["fit", "experiment=tiny-cpu", f"paths.root={tmp_path}", "--print-config"]) == 0
    printed = OmegaConf.create(capsys.readouterr().out)
    assert printed == compose(["experiment=tiny-cpu", f"paths.root={tmp_path}"])
    assert not any(tmp_path.iterdir())  # nothing written


def test_help_lists_the_six_verbs():
    out = subprocess.run([sys.executable, "-m", "atlas_lightning.cli", "--help"], capture_output=True, text=True).stdout
    for verb in ("fit", "validate", "memory-check", "plan", "publish", "data"):
        assert verb in out


def test_a_users_own_config_dir_and_callback_by_class_path(tmp_path):
    from atlas_lightning.run.wiring import build_callbacks

    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text(
        "# @package _global_\nname: mine\ntrainer:\n  total_steps: 2\n"
        "callbacks:\n  timer:\n    _target_: lightning.pytorch.callbacks.Timer\n    duration: '00:01:00:00'\n")
    cfg = compose(["experiment=mine"], user_config_dir=str(tmp_path))
    assert cfg.name == "mine" and cfg.trainer.total_steps == 2
    names = [type(c).__name__ for c in build_callbacks(cfg)]
    assert names[0] == "RLProgressBar" and "Timer" in names and names[-1] == "StepCheckpoint"

    with pytest.raises(ConfigError, match="callbacks.bad"):  # refused with the config, before any work
        compose(["experiment=tiny-cpu", "+callbacks.bad._target_=no.such.Callback"])


def test_outputs_go_under_paths_root_and_name(tmp_path):
    from atlas_lightning.run.wiring import prepare_run

    cfg = compose(["experiment=tiny-cpu", f"paths.root={tmp_path}", "name=demo"])
    prepare_run(cfg, "fit")
    dirs = run_dirs(cfg)
    assert dirs["outputs"] == tmp_path / "outputs" / "demo" == Path(cfg.paths.outputs)
    assert dirs == {"root": tmp_path, "artifacts": tmp_path / "artifacts" / "demo",
                    "checkpoints": tmp_path / "checkpoints" / "demo", "outputs": tmp_path / "outputs" / "demo",
                    "logs": tmp_path / "logs", "wandb": tmp_path / "wandb", "runs": tmp_path / "runs" / "demo"}
    assert OmegaConf.load(dirs["outputs"] / "config.yaml") == cfg
    assert (dirs["outputs"] / "main_ppo.log").exists()  # the name report 28's runs wrote
    assert not (dirs["outputs"] / "main.log").exists()
    assert len(list((tmp_path / "logs").glob("demo-*-fit.log"))) == 1


@pytest.mark.parametrize("verb, option, value, named", [
    ("tiny-orchestrator", "--eval-questions", "-1", "-1 is negative"),
    ("tiny-orchestrator", "--eval-questions", "eight", "'eight' is not an integer"),
    ("sample", "--seed", "-1", "-1 is negative"),
    ("tiny-model", "--seed", "4294967296", "4294967296 is above 2**32 - 1"),
    ("sample", "--out", "", "empty: name a folder"),  # would be the working directory
    ("tiny-orchestrator", "--base", " ", "empty: name a folder"),
])
def test_a_bad_data_option_is_refused_before_any_build(verb, option, value, named, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["data", verb, "--out", str(tmp_path / "o"), option, value]
    with pytest.raises(SystemExit) as stop:
        main(args if option != "--out" else ["data", verb, "--out", value])
    assert stop.value.code == 2
    assert f"argument {option}: {named}" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("card_gib", ["inf", "nan", "0", "-80"])
def test_a_card_memory_that_is_not_a_positive_finite_number_is_refused(card_gib, tmp_path, capsys):
    assert main(["plan", "experiment=r28-continued-cost-8gpu-n32", f"paths.root={tmp_path}", "--card-gib", card_gib]) == 2
    assert "GiB must be positive and finite (plan.card_gib / --card-gib)" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # an infinite card would plan every phase as fitting, and write it


def test_the_tests_read_no_users_cache():
    """``paths.cache`` (where ``make demo`` installs the tiny model, the sample and the orchestrator)
    is an empty folder of this test session (``tests/conftest.py``), never the user's: a test that
    needs them takes the session fixtures."""
    import os
    import tempfile

    cache = Path(compose(["experiment=tiny-cpu"]).paths.cache)
    assert cache == Path(os.environ["ATLAS_LIGHTNING_CACHE"]) and cache.parent == Path(tempfile.gettempdir())
    assert cache != Path.home() / ".cache" / "atlas-lightning" and not any(cache.iterdir())
