"""conf/callbacks/default.yaml (the standard set) composes with the real configs and builds every callback."""

from __future__ import annotations

from hydra.utils import instantiate

from atlas_lightning.callbacks.artifacts import ArtifactDumpCallback
from atlas_lightning.callbacks.checkpoint import StepCheckpoint
from atlas_lightning.callbacks.figures import FiguresCallback
from atlas_lightning.callbacks.hub import HubCheckpointCallback
from atlas_lightning.callbacks.nan_guard import NaNGuardCallback
from atlas_lightning.callbacks.validation import ValidationCallback
from atlas_lightning.callbacks.weight_sync import WeightSyncCallback
from atlas_lightning.config import compose


def test_standard_callbacks_compose_and_instantiate():
    cfg = compose(["experiment=tiny-cpu", "trainer.val_every=3", "trainer.val_before_train=false",
                   "callbacks.nan_guard.policy=rollback"])
    built = {name: instantiate(spec) for name, spec in cfg.callbacks.items()}
    assert {name: type(cb) for name, cb in built.items()} == {
        "weight_sync": WeightSyncCallback,
        "nan_guard": NaNGuardCallback, "artifacts": ArtifactDumpCallback,
        "validation": ValidationCallback, "figures": FiguresCallback,
        "hub": HubCheckpointCallback, "checkpoint": StepCheckpoint,
    }
    assert list(built)[0] == "weight_sync"  # validation after step N samples the step-N weights
    assert built["checkpoint"].every_n_steps == cfg.trainer.save_every and not built["hub"].enabled
    assert built["validation"].val_every == 3 and built["validation"].val_before_train is False
    assert built["nan_guard"].policy == "rollback"
