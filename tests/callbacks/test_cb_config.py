"""conf/callbacks/default.yaml (the standard set) composes with the real configs and builds every callback;
the weight sync is none of them (it is the PPO step's last phase)."""

from __future__ import annotations

from atlas_lightning.callbacks.progress import RLProgressBar

from hydra.utils import instantiate

from atlas_lightning.callbacks.artifacts import ArtifactDumpCallback
from atlas_lightning.callbacks.checkpoint import StepCheckpoint
from atlas_lightning.callbacks.figures import FiguresCallback
from atlas_lightning.callbacks.hub import HubCheckpointCallback
from atlas_lightning.callbacks.nan_guard import NaNGuardCallback
from atlas_lightning.callbacks.validation import ValidationCallback
from atlas_lightning.config import compose


def test_standard_callbacks_compose_and_instantiate():
    cfg = compose(["experiment=tiny-cpu", "trainer.val_every=3", "trainer.val_before_train=false",
                   "callbacks.nan_guard.policy=rollback"])
    built = {name: instantiate(spec) for name, spec in cfg.callbacks.items()}
    assert {name: type(cb) for name, cb in built.items()} == {
        "progress": RLProgressBar,
        "nan_guard": NaNGuardCallback, "artifacts": ArtifactDumpCallback,
        "validation": ValidationCallback, "figures": FiguresCallback,
        "hub": HubCheckpointCallback, "checkpoint": StepCheckpoint,
    }
    # validation after step N samples the step-N weights because the step syncs them, not by the
    # order of this list (tests/ppo/test_weight_sync_stage.py)
    assert not any("sync" in name or "Sync" in type(cb).__name__ for name, cb in built.items())
    assert built["checkpoint"].every_n_steps == cfg.trainer.save_every and not built["hub"].enabled
    assert built["validation"].val_every == 3 and built["validation"].val_before_train is False
    assert built["nan_guard"].policy == "rollback"
    assert built["progress"].total_steps == cfg.trainer.total_steps


def test_callbacks_take_their_folders_and_settings_from_the_config(tmp_path):
    """Every setting and folder comes in as an argument interpolated from the run's keys: a
    change of ``paths.root``, ``name`` or ``trainer.total_steps`` reaches every callback, and the
    run's record gets the resolved config and the LoRA shapes of the run's facts."""
    from pathlib import Path

    from atlas_lightning.run.facts import RunFacts, StartingPoint
    from atlas_lightning.run.wiring import build_callbacks
    from atlas_lightning.store.lora_shapes import config_lora_shape

    cfg = compose(["experiment=tiny-cpu", f"paths.root={tmp_path}", "name=run-a", "trainer.total_steps=7"])
    artifacts, checkpoints = tmp_path / "artifacts" / "run-a", tmp_path / "checkpoints" / "run-a"
    lora = {role: config_lora_shape(cfg, role) for role in ("actor", "critic")}
    facts = RunFacts(folders={}, lora=lora, questions=None, start=StartingPoint())
    built = {type(cb).__name__: cb for cb in build_callbacks(cfg, facts)}
    guard, record = built["NaNGuardCallback"], built["ArtifactDumpCallback"]
    validation, figures, checkpoint = built["ValidationCallback"], built["FiguresCallback"], built["StepCheckpoint"]
    assert (guard.artifacts, guard.checkpoints, guard.run_id) == (artifacts, checkpoints, "run-a")
    assert (validation.artifacts, validation.checkpoints, validation.run_id) == (artifacts, checkpoints, "run-a")
    assert (record.artifacts, record.run_id, figures.artifacts, checkpoint.checkpoints) == (
        artifacts, "run-a", artifacts, checkpoints)
    assert validation.total_steps == figures.total_steps == checkpoint.total_steps == 7
    assert record.lora == lora and record.config["trainer"]["total_steps"] == 7
    assert Path(cfg.paths.outputs) == tmp_path / "outputs" / "run-a"
