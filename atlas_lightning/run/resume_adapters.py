"""Do a checkpoint's adapters fit the model this run builds? Checked before a resume writes anything.

A resume restores the actor and critic adapters a checkpoint holds into the model this run
builds: ``model.path`` with each adapter's LoRA as this run resolves it (``model.lora``,
``model.critic_lora``, or a starting folder's own: ``store.lora_shapes.lora_shapes``). One
trained with another rank, alpha, per-module pattern, rsLoRA or other target modules, or on a
base of other shapes, cannot be restored into it. ``PPOModule._check_resume`` refuses such a
checkpoint once the model is built, which is after the run's ``config.yaml`` and logs are
written; this refuses it from the files alone (each adapter's ``adapter_config.json`` and
``atlas_base.json``, ``model.path``'s ``config.json``) before anything is written. What needs
the weights stays with the build: the base's fingerprint (same shapes, other weights). The
adapters' files are read here as the build reads them (readable, every tensor finite, each its
own role's); their shapes against the state Lightning restores: ``run/resume_tensors.py``.

Who calls it: ``run/facts.resume_path`` (fit and validate). ``ConfigError`` naming the key,
the adapter folder and what differs.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from atlas_lightning.config import ConfigError
from atlas_lightning.store.lora_shapes import LoraShape


def check_resume_adapters(cfg: DictConfig, folder: Path, key: str) -> None:
    """Refuse ``folder`` (a verified ``global_step_N``, named by ``key``) when an adapter it holds
    was trained with other LoRA settings than this run's, or on a base of other config fields
    (module doc)."""
    from atlas_lightning.planning.shapes import read_model_shape
    from atlas_lightning.run.adapter_files import check_adapter_base
    from atlas_lightning.store.lora_shapes import AdapterConfigError, ROLES, lora_shapes, read_lora_shape

    from atlas_lightning.errors import InputError
    from atlas_lightning.models.adapters import read_adapter_folder

    base = read_model_shape(cfg.model.path)
    trained = lora_shapes(cfg)
    for role in ROLES:
        adapter = Path(folder) / role / "lora_adapter"
        try:
            saved = read_lora_shape(adapter)
        except AdapterConfigError as err:
            raise ConfigError(f"{key}: {err}") from None
        check_adapter_base(base, adapter, key)
        differ = _differences(saved, trained[role], base)
        if differ:
            raise ConfigError(
                f"{key}: its {role} adapter ({adapter}) was trained with {', '.join(differ)}: it cannot be restored "
                f"into this run's {role} adapter ({trained[role].describe()}, from {trained[role].source}); resume "
                f"with the checkpoint's settings, or start a new run from its adapters with trainer.init_from={folder} "
                f"trainer.resume=null")
        try:  # its files and tensors as the build reads them: readable, finite, its own role's
            read_adapter_folder(adapter, role)
        except (InputError, FileNotFoundError) as err:
            raise ConfigError(f"{key}: {err}") from None


def _differences(saved: LoraShape, mine: LoraShape, base) -> list[str]:
    """``field=<saved> (this run: <mine>)`` for each LoRA setting that differs (``models.adapters``
    compares the same ones on the built model), target modules as this base's linear names."""
    from atlas_lightning.run.adapter_files import target_names

    settings = {"r": (saved.rank, mine.rank), "lora_alpha": (float(saved.alpha), float(mine.alpha)),
                "use_rslora": (saved.use_rslora, mine.use_rslora),
                "rank_pattern": (saved.rank_pattern or {}, mine.rank_pattern or {}),
                "alpha_pattern": (saved.alpha_pattern or {}, mine.alpha_pattern or {}),
                "target_modules": (target_names(saved, base), target_names(mine, base))}
    return [f"{name}={theirs!r} (this run: {ours!r})" for name, (theirs, ours) in settings.items() if theirs != ours]
