"""Build the configured rollout engine for this process, after the process group exists.

Who calls it: ``RolloutDataModule.setup`` (Lightning calls ``setup`` after the strategy has made
its process group, which in-process vLLM engines need: construction is collective).
"""

from __future__ import annotations

import os

import torch
from omegaconf import DictConfig

from atlas_lightning.rollout.engine import Engine


def engine_world(rank: int, world_size: int, tp: int) -> tuple[int, int, int]:
    """(engine index, number of engines, rank within the engine's TP group) for ``rank``."""
    if tp <= 0 or world_size % tp:
        raise ValueError(f"rollout.tensor_parallel_size={tp} must divide the {world_size} training processes")
    return rank // tp, world_size // tp, rank % tp


def build_engine(cfg: DictConfig, rank: int = 0, local_rank: int = 0, world_size: int = 1) -> Engine:
    """The engine of ``cfg.rollout.engine`` serving ``cfg.model.path``."""
    kind = cfg.rollout.engine
    if kind == "vllm":
        from atlas_lightning.rollout.vllm_engine import VLLMEngine

        tp = cfg.rollout.tensor_parallel_size
        external = world_size > 1
        if external:
            # vLLM's external launcher reads torchrun's variables; Lightning's launcher sets none.
            os.environ["RANK"] = str(rank)
            os.environ["LOCAL_RANK"] = str(local_rank)
            os.environ["WORLD_SIZE"] = str(world_size)
        return VLLMEngine(
            cfg.model.path,
            dtype=cfg.model.dtype,
            max_model_len=cfg.rollout.max_model_len,
            lora_rank=cfg.model.lora.rank if cfg.rollout.weight_sync == "lora" else None,
            tensor_parallel_size=tp,
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            enable_sleep_mode=cfg.rollout.enable_sleep_mode,
            enforce_eager=cfg.rollout.enforce_eager,
            seed=cfg.seed,
            external_launcher=external,
            cpu_kvcache_gib=cfg.rollout.cpu_kvcache_gib,
            max_num_seqs=min(cfg.rollout.max_in_flight, 1024),
        )
    if kind == "hf":
        from transformers import AutoModelForCausalLM

        from atlas_lightning.rollout.hf_engine import HFEngine

        dtype = getattr(torch, cfg.model.dtype)
        model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=dtype)
        if torch.cuda.is_available():
            model = model.to(f"cuda:{local_rank}")
        return HFEngine(model)
    raise NotImplementedError(f"rollout.engine={kind!r}: the vLLM server client lands with the scale issue (#8)")
