"""A fit that starts afresh under a name whose folders hold an earlier run's training is refused
before anything is written (exit 2): it used to write its own step 1 over the earlier run's, leave
that run's later checkpoints beside it for ``trainer.resume=auto`` to continue, and name them in
its closing summary. ``trainer.resume=auto`` goes on from that run; ``validate`` reads it."""

from __future__ import annotations

import pytest

from atlas_lightning.cli import main
from atlas_lightning.config import ConfigError
from atlas_lightning.run.facts import resume_path
from tests.conftest import write_fake_model_folder


def _files(root):
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("earlier", ["checkpoints/run/global_step_1/actor/x",
                                     "checkpoints/run/global_step_2/checkpoint.json",
                                     "artifacts/run/train/step_1/gpqa-train-0001_n000.json"])
def test_a_fresh_fit_over_an_earlier_run_exits_2_and_changes_no_file(earlier, tmp_path, sample_data_dir, capsys):
    root = tmp_path / "root"
    (root / earlier).parent.mkdir(parents=True)
    (root / earlier).write_text("the earlier run's")
    before = _files(root)
    code = main(["fit", "experiment=tiny-cpu", f"paths.root={root}", "name=run", f"data.root={sample_data_dir}",
                 f"model.path={write_fake_model_folder(tmp_path / 'model')}"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    folder = root / earlier.split("/step_")[0].rsplit("/global_step_", 1)[0]
    assert err.startswith(f"atlas-lightning fit: config error: name=run: {folder} holds an earlier run's steps ("), err
    assert "trainer.resume=auto" in err and "\n" not in err and "Traceback" not in err
    assert _files(root) == before


def test_the_refusal_lists_the_steps_in_order(cfg_of, tmp_path):
    cfg = cfg_of()
    for step in (1, 2, 10, 11):
        (tmp_path / "checkpoints" / "run" / f"global_step_{step}").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"\(global_step_1, global_step_2, global_step_10 and 1 more\)"):
        resume_path(cfg, tmp_path / "checkpoints" / "run")


def test_auto_and_validation_are_not_refused_for_an_earlier_run(cfg_of, tmp_path):
    (tmp_path / "artifacts" / "run" / "train" / "step_1").mkdir(parents=True)
    checkpoints = tmp_path / "checkpoints" / "run"
    assert resume_path(cfg_of("trainer.resume=auto"), checkpoints).resume is None  # none complete: afresh
    assert resume_path(cfg_of(), checkpoints, training=False).resume is None  # validate reads a run


def test_a_fresh_fit_under_a_new_name_or_an_empty_folder_passes(cfg_of, tmp_path):
    (tmp_path / "checkpoints" / "other" / "global_step_1").mkdir(parents=True)
    (tmp_path / "checkpoints" / "run").mkdir(parents=True)
    (tmp_path / "artifacts" / "run" / "val" / "step_0").mkdir(parents=True)  # a validation alone trains nothing
    assert resume_path(cfg_of(), tmp_path / "checkpoints" / "run").resume is None


def test_preflight_builds_the_reward_scorer_as_fit_does(tmp_path, sample_data_dir, tiny_model_dir):
    from atlas_lightning.run.preflight import run_preflight

    lines = []
    results = run_preflight(["experiment=tiny-cpu", f"paths.root={tmp_path}", f"model.path={tiny_model_dir}",
                             f"data.root={sample_data_dir}", "+reward.nokey=1"], cpu=True, echo=lines.append)
    reward = next(check for check in results if check.name == "reward")
    assert not reward.ok and "cannot build the reward scorer" in reward.detail and "nokey" in reward.detail
    results = run_preflight(["experiment=tiny-cpu", f"paths.root={tmp_path}", f"model.path={tiny_model_dir}",
                             f"data.root={sample_data_dir}"], cpu=True, echo=lines.append)
    assert next(check for check in results if check.name == "reward").ok
