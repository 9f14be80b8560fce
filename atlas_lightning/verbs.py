"""What each config verb does, once its config has composed and validated (``cli.py``)."""

from __future__ import annotations

from omegaconf import DictConfig


def fit(cfg: DictConfig) -> int:
    raise NotImplementedError("`fit` lands with the rollout and PPO issues (#4, #5)")


def validate(cfg: DictConfig) -> int:
    raise NotImplementedError("`validate` lands with the callbacks issue (#6)")


def memory_check(cfg: DictConfig) -> int:
    raise NotImplementedError("`memory-check` lands with the scale issue (#8)")


def plan(cfg: DictConfig) -> int:
    raise NotImplementedError("`plan` lands with the scale issue (#8)")


def publish(cfg: DictConfig, weights: bool = False) -> int:
    raise NotImplementedError("`publish` lands with the callbacks issue (#6)")
