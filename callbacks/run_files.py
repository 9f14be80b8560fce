"""Atomic text writes for the run export and the publish step: ``atlas_lightning.atomic``'s
(no torch/Lightning import, so ``atlas-lightning publish`` starts fast)."""

from atlas_lightning.atomic import atomic_write_text

__all__ = ["atomic_write_text"]
