"""The one builder of the trained model: ``build_actor_critic`` (``ActorCritic`` from the
``model`` config group, then its starting adapters).

Who calls it: ``PPOModule.configure_model`` (which shards the result under FSDP2), tests.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .actor_critic import ACTOR, CRITIC, ActorCritic
from .adapters import adapter_lora_config, load_adapter


def build_actor_critic(model_cfg: Any, *, seed: int = 0, actor_adapter: Optional[str] = None,
                       critic_adapter: Optional[str] = None,
                       device: str | torch.device | None = None) -> ActorCritic:
    """``ActorCritic`` from ``model_cfg`` (``config.ModelConfig``: base path, dtype, LoRA,
    checkpointing, chunk size, attention, layout, kernels), adapters initialised from ``seed``;
    then the starting adapters: ``actor_adapter`` / ``critic_adapter`` (PEFT folders), else
    ``model_cfg.actor_adapter`` / ``critic_adapter``.

    Each adapter has its own LoRA shape: an adapter that starts from a folder is built with the
    LoRA that folder's ``adapter_config.json`` describes (rank, alpha, target modules, per-module
    patterns: ``adapter_lora_config``), whatever ``model_cfg.lora`` says; a fresh one with
    ``model_cfg.lora`` (actor) or ``model_cfg.critic_lora``'s fields over it (critic;
    ``store.lora_shapes.fresh_lora_spec``). The folders' tensors are then checked against this
    base and loaded (``adapters.load_adapter``).
    Unsharded: the caller shards it (``sharding.shard``)."""
    from atlas_lightning.store.lora_shapes import fresh_lora_spec

    folders = {ACTOR: actor_adapter or model_cfg.actor_adapter, CRITIC: critic_adapter or model_cfg.critic_adapter}
    lora = {role: adapter_lora_config(folder) if folder else fresh_lora_spec(model_cfg, role)
            for role, folder in folders.items()}
    model = ActorCritic(
        model_cfg.path,
        lora[ACTOR],
        critic_lora=lora[CRITIC],
        dtype=model_cfg.dtype,
        gradient_checkpointing=model_cfg.gradient_checkpointing,
        logprob_chunk_tokens=model_cfg.logprob_chunk_tokens,
        attn_implementation=model_cfg.attn_implementation,
        sequence_layout=model_cfg.sequence_layout,
        fused_lora=model_cfg.fused_lora,
        checkpoint_layers=model_cfg.checkpoint_layers,
        lean_activations=model_cfg.lean_activations,
        linear_attention_kernel=model_cfg.linear_attention_kernel,
        elementwise_kernels=model_cfg.elementwise_kernels,
        attention_length_bucket=model_cfg.attention_length_bucket,
        layer_recompute=list(model_cfg.layer_recompute) if model_cfg.layer_recompute is not None else None,
        init_seed=seed,
        device=device,
    )
    for role, folder in folders.items():
        if folder:
            load_adapter(model, role, folder)
    return model
