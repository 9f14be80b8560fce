"""``validate trainer.resume=auto`` asks for the run's own weights: with no checkpoint of that run
(a mistyped name, another paths.root) it is refused before anything is written, where it used to
score the starting adapters and file their numbers as the run's step 0."""

from __future__ import annotations

from atlas_lightning.cli import main
from tests.conftest import write_fake_model_folder


def test_validate_auto_with_no_checkpoint_exits_2_naming_the_run_and_writes_nothing(tmp_path, sample_data_dir, capsys):
    root = tmp_path / "root"
    code = main(["validate", "experiment=tiny-cpu", f"paths.root={root}", "name=typo", "trainer.resume=auto",
                 f"data.root={sample_data_dir}", f"model.path={write_fake_model_folder(tmp_path / 'model')}"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("atlas-lightning validate: config error: trainer.resume=auto: no checkpoint of run 'typo' "
                          f"under {root}/checkpoints/typo to validate"), err
    assert "\n" not in err and "Traceback" not in err
    assert not root.exists() or not any(p.is_file() for p in root.rglob("*"))


def test_fit_auto_with_no_checkpoint_still_starts_afresh(tmp_path, cfg_of):
    from atlas_lightning.run.facts import resume_path

    cfg = cfg_of("trainer.resume=auto")
    start = resume_path(cfg, tmp_path / "checkpoints" / cfg.name, training=True)
    assert start.resume is None and start.state is None
