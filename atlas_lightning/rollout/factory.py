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
    """The engine of ``cfg.rollout.engine`` serving ``cfg.model.path`` (the separate layout:
    this rank's client of the shared server, ``separate.py``; collective)."""
    if cfg.layout.mode == "separate":
        from atlas_lightning.rollout.separate import build_separate_engine

        return build_separate_engine(cfg, rank, world_size)
    kind = cfg.rollout.engine
    if kind == "vllm":
        from atlas_lightning.rollout.engines.vllm_engine import VLLMEngine

        tp = cfg.rollout.tensor_parallel_size
        # under a training process group (ModelParallelStrategy, world 1 on a GPU included) the
        # engine joins it; a CPU run without one (strategy "auto") keeps vLLM's own world
        external = world_size > 1 or (torch.distributed.is_available() and torch.distributed.is_initialized())
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
            # merged sync reloads every weight after each update: the sleeping engine need not keep them
            sleep_level=2 if cfg.rollout.weight_sync == "merged" else 1,
        )
    if kind == "hf":
        from transformers import AutoModelForCausalLM

        from atlas_lightning.rollout.engines.hf_engine import HFEngine

        dtype = getattr(torch, cfg.model.dtype)
        model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=dtype)
        if torch.cuda.is_available():
            model = model.to(f"cuda:{local_rank}")
        return HFEngine(model)
    if kind == "vllm-server":
        return _build_server_engine(cfg, rank, local_rank, world_size)
    raise NotImplementedError(f"rollout.engine={kind!r} is not an engine this build knows")


def _build_server_engine(cfg: DictConfig, rank: int, local_rank: int, world_size: int) -> Engine:
    """A ``ServerEngine`` on a server this rank starts (or on ``rollout.server_url``).

    Supported: one process (the server runs TP ``rollout.tensor_parallel_size``), or several
    processes at TP 1 (each rank is its engine's only member and starts its own server, on its
    own card where there are cards). Refused, with the reason: TP groups over several training
    processes and merged-weight sync (both are the separate layout's), one ``server_url`` for
    several engines, and sleep mode on GPUs."""
    from atlas_lightning.config import run_dirs
    from atlas_lightning.rollout.engines.server_engine import ServerEngine
    from atlas_lightning.rollout.engines.server_process import VLLMServer

    r = cfg.rollout
    _, engines, _ = engine_world(rank, world_size, r.tensor_parallel_size)
    if world_size > 1 and r.tensor_parallel_size > 1:
        # the group's ranks would each send the group's identical requests to one server
        raise NotImplementedError(
            f"rollout.engine=vllm-server with rollout.tensor_parallel_size={r.tensor_parallel_size} over "
            f"{world_size} training processes: a server on cards of its own is the separate layout "
            f"(layout.mode=separate); use tensor_parallel_size=1 or rollout.engine=vllm")
    if r.weight_sync != "lora":
        raise NotImplementedError(
            f"rollout.engine=vllm-server with rollout.weight_sync={r.weight_sync!r} in a colocated layout: merged "
            f"weights reach a server through vLLM's weight-transfer API in the separate layout "
            f"(layout.mode=separate); here use rollout.weight_sync=lora")
    if r.get("server_url"):
        if engines > 1:
            raise NotImplementedError(
                f"rollout.server_url names one server but there are {engines} engines; each engine "
                f"swaps its own adapter, so each needs its own server (leave server_url unset)")
        return ServerEngine(r.server_url, max_in_flight=r.max_in_flight, request_timeout_s=r.request_timeout_s + 60,
                            lora_dtype=cfg.model.dtype)
    cuda = torch.cuda.is_available()
    if cuda and r.enable_sleep_mode:
        raise NotImplementedError("rollout.engine=vllm-server cannot sleep (its /sleep route is dev-mode only); "
                                  "set rollout.enable_sleep_mode=false or use rollout.engine=vllm")
    env = {}
    if cuda and world_size > 1:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[local_rank] if visible else str(local_rank)
    server = VLLMServer(
        cfg.model.path,
        log_path=run_dirs(cfg)["logs"] / f"vllm-server-{cfg.name}-rank{rank}.log",
        dtype=cfg.model.dtype,
        max_model_len=r.max_model_len,
        lora_rank=cfg.model.lora.rank,
        tensor_parallel_size=r.tensor_parallel_size,
        gpu_memory_utilization=r.gpu_memory_utilization,
        enforce_eager=r.enforce_eager,
        seed=cfg.seed,
        cpu_kvcache_gib=r.cpu_kvcache_gib,
        max_num_seqs=min(r.max_in_flight, 1024),
        start_timeout_s=r.get("server_start_timeout_s", 600.0),
        env=env,
    )
    try:
        # the socket waits a minute past the agent loop's timeout, so the loop's abort comes first
        return ServerEngine(server.url, server=server, max_in_flight=r.max_in_flight,
                            request_timeout_s=r.request_timeout_s + 60, lora_dtype=cfg.model.dtype)
    except BaseException:
        server.close()
        raise
