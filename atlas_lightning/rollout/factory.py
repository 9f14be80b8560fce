"""Build the configured rollout engine for this process, after the process group exists.

``rollout.engine`` names the engine: a short name of the package's own (``config.ENGINE_ALIASES``:
``vllm`` -> ``vllm_engine``, ``vllm-server`` -> ``server_engine``, ``hf`` -> ``hf_engine``, the
factories below) or the dotted path of any class or function, e.g.
``rollout.engine=my_pkg.engines.MyEngine``. It is called as ``target(cfg, rank=, local_rank=,
world_size=)`` with the run's whole config and must return an ``Engine`` (``engine.py``); it
runs on every training process at the same point, so construction may be collective. A target
that takes an ``actor_lora`` argument also gets the LoRA shape the actor trains (a
``store.lora_shapes.LoraShape`` the run resolved once, or None: resolve it from ``cfg``), as the
package's vLLM engines do to size their LoRA slot. The separate layout is built apart (``separate.py``: one shared server; it serves ``vllm-server``
only).

Who calls it: ``RolloutDataModule.setup`` (Lightning calls ``setup`` after the strategy has made
its process group, which in-process vLLM engines need: construction is collective).
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Optional

import torch
from omegaconf import DictConfig

from atlas_lightning.config import ENGINE_ALIASES
from atlas_lightning.rollout.engine import Engine
from atlas_lightning.rollout.engines.args import EngineArgs
from atlas_lightning.store.lora_shapes import LoraShape


def engine_world(rank: int, world_size: int, tp: int) -> tuple[int, int, int]:
    """(engine index, number of engines, rank within the engine's TP group) for ``rank``."""
    if tp <= 0 or world_size % tp:
        raise ValueError(f"layout.engine_tp={tp} must divide the {world_size} training processes")
    return rank // tp, world_size // tp, rank % tp


def build_engine(cfg: DictConfig, rank: int = 0, local_rank: int = 0, world_size: int = 1,
                 actor_lora: Optional[LoraShape] = None) -> Engine:
    """The engine of ``cfg.rollout.engine`` (module doc) serving ``cfg.model.path`` (the separate
    layout: this rank's client of the shared server, ``separate.py``; collective). ``TypeError``
    naming ``rollout.engine`` when the target does not return an ``Engine``. vLLM engines and
    servers get ``EngineArgs.from_config(cfg, actor_lora)`` (``engines/args.py``); ``actor_lora``:
    the actor's LoRA shape as the run resolved it (``run.facts``; None: from ``cfg``)."""
    if cfg.layout.mode == "separate":
        from atlas_lightning.rollout.separate import build_separate_engine

        return build_separate_engine(cfg, rank, world_size, actor_lora=actor_lora)
    from hydra.utils import get_object

    name = cfg.rollout.engine
    target = ENGINE_ALIASES.get(name, name)
    try:
        factory = get_object(target)
    except Exception as err:  # a path that config validation could not check to the end
        raise ImportError(f"rollout.engine={name!r}: cannot import {target}: {err}") from err
    extra = {"actor_lora": actor_lora} if _takes(factory, "actor_lora") else {}
    engine = factory(cfg, rank=rank, local_rank=local_rank, world_size=world_size, **extra)
    if not isinstance(engine, Engine):
        raise TypeError(f"rollout.engine={name!r}: {target} returned a {type(engine).__name__}, not an "
                        f"atlas_lightning.rollout.engine.Engine")
    return engine


def _takes(factory, name: str) -> bool:
    """Whether ``factory`` (a function or class) has a parameter ``name``."""
    try:
        return name in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a callable whose signature Python cannot read takes the base contract
        return False


def vllm_engine(cfg: DictConfig, *, rank: int, local_rank: int, world_size: int,
                actor_lora: Optional[LoraShape] = None) -> Engine:
    """``rollout.engine=vllm``: in-process ``vllm.LLM`` (``engines/vllm_engine.py``); the ranks
    of a TP group form one engine through vLLM's external launcher."""
    from atlas_lightning.rollout.engines.vllm_engine import VLLMEngine

    # under a training process group (ModelParallelStrategy, world 1 on a GPU included) the engine
    # joins it; a CPU run without one (strategy "auto") keeps vLLM's own world
    external = world_size > 1 or (torch.distributed.is_available() and torch.distributed.is_initialized())
    if external:
        # vLLM's external launcher reads torchrun's variables; Lightning's launcher sets none.
        os.environ["RANK"] = str(rank)
        os.environ["LOCAL_RANK"] = str(local_rank)
        os.environ["WORLD_SIZE"] = str(world_size)
    # a merged sync reloads every weight after each update: a sleeping engine need not keep them
    sleep_level = 2 if cfg.rollout.weight_sync == "merged" else 1
    return VLLMEngine(EngineArgs.from_config(cfg, actor_lora), external_launcher=external, sleep_level=sleep_level)


def hf_engine(cfg: DictConfig, *, rank: int, local_rank: int, world_size: int) -> Engine:
    """``rollout.engine=hf``: the transformers reference engine (``engines/hf_engine.py``), on
    this process's card when there are cards."""
    from transformers import AutoModelForCausalLM

    from atlas_lightning.models.build import causal_lm_config
    from atlas_lightning.rollout.engines.hf_engine import HFEngine

    dtype = getattr(torch, cfg.model.dtype)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, config=causal_lm_config(cfg.model.path), dtype=dtype)
    if torch.cuda.is_available():
        model = model.to(f"cuda:{local_rank}")
    return HFEngine(model)


def server_engine(cfg: DictConfig, *, rank: int, local_rank: int, world_size: int,
                  actor_lora: Optional[LoraShape] = None) -> Engine:
    """``rollout.engine=vllm-server``: a ``ServerEngine`` on a server this rank starts (or on
    ``rollout.server_url``).

    Supported: one process (the server runs TP ``layout.engine_tp``), or several
    processes at TP 1 (each rank is its engine's only member and starts its own server, on its
    own card where there are cards). Refused, with the reason: TP groups over several training
    processes and merged-weight sync (both are the separate layout's), one ``server_url`` for
    several engines, and sleep mode on GPUs."""
    from atlas_lightning.rollout.engines.server_engine import ServerEngine
    from atlas_lightning.rollout.engines.server_process import VLLMServer

    r, tp = cfg.rollout, cfg.layout.engine_tp
    _, engines, _ = engine_world(rank, world_size, tp)
    if world_size > 1 and tp > 1:
        # the group's ranks would each send the group's identical requests to one server
        raise NotImplementedError(
            f"rollout.engine=vllm-server with layout.engine_tp={tp} over "
            f"{world_size} training processes: a server on cards of its own is the separate layout "
            f"(layout.mode=separate); use layout.engine_tp=1 or rollout.engine=vllm")
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
        return ServerEngine(r.server_url, max_in_flight=r.max_in_flight, request_timeout_s=r.request_timeout_s + 60)
    cuda = torch.cuda.is_available()
    if cuda and r.enable_sleep_mode:
        raise NotImplementedError("rollout.engine=vllm-server cannot sleep (its /sleep route is dev-mode only); "
                                  "set rollout.enable_sleep_mode=false or use rollout.engine=vllm")
    env = {}
    if cuda and world_size > 1:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[local_rank] if visible else str(local_rank)
    server = VLLMServer(
        EngineArgs.from_config(cfg, actor_lora),
        log_path=Path(cfg.paths.logs) / f"vllm-server-{cfg.name}-rank{rank}.log",
        start_timeout_s=r.server_start_timeout_s,
        env=env,
    )
    try:
        # the socket waits a minute past the agent loop's timeout, so the loop's abort comes first
        return ServerEngine(server.url, server=server, max_in_flight=r.max_in_flight,
                            request_timeout_s=r.request_timeout_s + 60)
    except BaseException:
        server.close()
        raise
