"""Tests' way to an ``ActorCritic``: the model config's keys as keyword arguments.

``actor_critic(base, lora, logprob_chunk_tokens=5)`` is ``actor_critic(ModelConfig(...), base,
{actor: lora, critic: lora})`` with a folder's base loaded by ``models.build.load_base``, as
``fit`` loads it. Test defaults where the schema's suit a GPU run: float32 and no gradient
checkpointing (a test asks for either by name)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from torch import nn

from atlas_lightning.config import ModelConfig
from atlas_lightning.models.actor_critic import ACTOR, CRITIC, ActorCritic
from atlas_lightning.models.build import load_base

TEST_DEFAULTS = {"dtype": "float32", "gradient_checkpointing": False}


def model_config(**keys: Any) -> ModelConfig:
    """``config.ModelConfig`` with ``TEST_DEFAULTS`` under ``keys`` (any ``model.*`` key)."""
    return ModelConfig(**{**TEST_DEFAULTS, **keys})


def actor_critic(base: str | nn.Module, lora: Any, *, critic_lora: Any = None, init_seed: int = 0,
                 device: Optional[str] = None, **keys: Any) -> ActorCritic:
    """``ActorCritic`` on ``base`` (a model folder, loaded onto ``device``, or a built causal LM)
    with ``lora`` for the actor and ``critic_lora`` (default: ``lora``) for the critic."""
    config = model_config(**keys)
    if not isinstance(base, nn.Module):
        config = replace(config, path=str(base))
        base = load_base(config, device)
    return ActorCritic(config, base, {ACTOR: lora, CRITIC: critic_lora if critic_lora is not None else lora},
                       seed=init_seed)
