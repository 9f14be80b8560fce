"""Start and end in-process ``vllm.LLM`` instances at known moments, leaving the process's
process groups as they were.

Why: left to itself, vLLM ends an in-process engine when the garbage collector reaches it, and
its shutdown (``cleanup_dist_env_and_memory``) ends vLLM's process groups *and torch's default
process group*, whatever runs at that moment: another engine of this process that shares those
groups, or the trainer whose group it was. The next engine then fails to start ("Process group
... is not initialized in the world group map"), at a moment that depends on the collector.

Contract (who calls it: ``vllm_engine.VLLMEngine``, and tests that drive ``vllm.LLM`` directly):

- ``start_llm(**kwargs)`` builds ``vllm.LLM(**kwargs)`` and counts it live in this process; torch's
  warnings about Triton kernels it cannot analyse come as one line (``compile_warnings``).
- ``shut_down_llm(llm)`` ends that engine now: its worker, scheduler and caches. vLLM's own
  process groups (shared by every in-process engine) end with the last live engine; torch's
  default process group ends with them only if the first of the live engines made it (an
  engine that joined the trainer's group leaves it to the trainer). Calling it twice is a no-op.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any
from unittest import mock

import torch

from atlas_lightning.rollout.engines.compile_warnings import summarise_kernel_analysis_failures

#: ids of the live ``vllm.LLM`` instances started here.
_live: set[int] = set()
#: Whether torch's default process group existed before the first live engine started.
_default_group_was_there = False


def _default_group_exists() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def start_llm(**kwargs: Any):
    """``vllm.LLM(**kwargs)``, counted live until ``shut_down_llm``."""
    global _default_group_was_there
    from vllm import LLM

    summarise_kernel_analysis_failures()  # the engine's first compile may otherwise log a traceback a kernel
    if not _live:
        _default_group_was_there = _default_group_exists()
    llm = LLM(**kwargs)
    _live.add(id(llm))
    return llm


def _end_vllm_world_only() -> None:
    """vLLM's ``destroy_distributed_environment`` less its last act (ending torch's default
    process group, which is the trainer's here)."""
    from vllm.distributed import parallel_state

    if parallel_state._WORLD is not None:
        parallel_state._WORLD.destroy()
    parallel_state._WORLD = None
    if hasattr(parallel_state, "_NODE_COUNT"):
        parallel_state._NODE_COUNT = None


def shut_down_llm(llm) -> None:
    """End ``llm``'s engine now (module doc). ``llm``: one ``start_llm`` returned."""
    if id(llm) not in _live:
        return
    _live.discard(id(llm))
    from vllm.distributed import parallel_state

    patches = []
    if _live:  # other engines still use vLLM's groups
        patches = [mock.patch.object(parallel_state, "destroy_model_parallel", lambda: None),
                   mock.patch.object(parallel_state, "destroy_distributed_environment", lambda: None)]
    elif _default_group_was_there:
        patches = [mock.patch.object(parallel_state, "destroy_distributed_environment", _end_vllm_world_only)]
    with ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        llm.llm_engine.engine_core.shutdown()  # detaches vLLM's collector-time finalizer

