"""Small helpers for "one process a card, rank 0 writes": gathering Python objects to rank 0
and barriers that are no-ops when not distributed."""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _alone() -> bool:
    """No other rank to wait for or combine with: no group, or a group of one (where a collective
    would still cost a round trip through the card: NCCL's reduce waits on the device)."""
    return not is_distributed() or dist.get_world_size() == 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_rank_zero() -> bool:
    return rank() == 0


def barrier() -> None:
    if not _alone():
        dist.barrier()


def shut_down() -> None:
    """End a multi-process group cleanly once a verb is done (barrier, then destroy). Left to
    the interpreter's exit, gloo's worker threads can be torn down while still joinable, and a
    finished rank aborts ("terminate called without an active exception").

    Left alone: a one-process group, and any group while in-process vLLM holds its own groups
    on it (vLLM's exit hook destroys those, and fails loudly if the default group is gone)."""
    if not is_distributed() or dist.get_world_size() == 1:
        return
    vllm_state = sys.modules.get("vllm.distributed.parallel_state")
    if vllm_state is not None and vllm_state.model_parallel_is_initialized():
        return
    dist.barrier()
    dist.destroy_process_group()


def gather_objects(obj: Any) -> Optional[list]:
    """Every rank's ``obj`` in rank order on rank 0 (None on the others). Collective."""
    if _alone():
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank. Collective."""
    if _alone():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_reduce_sum(values: list[float]) -> list[float]:
    """Element-wise sum of ``values`` over ranks (float64 on CPU; gloo and NCCL both serve it)."""
    if _alone():
        return list(values)
    import torch

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.cpu().tolist()


def all_reduce_max(values: list[float]) -> list[float]:
    """Element-wise maximum of ``values`` over ranks. Collective."""
    if _alone():
        return list(values)
    import torch

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.cpu().tolist()


T = TypeVar("T")


class RankZeroError(RuntimeError):
    """Raised on the other ranks when rank 0's part failed; names rank 0's error."""


def on_rank_zero(work: Callable[[], T], what: str) -> T:
    """Rank-0 work whose outcome every rank needs: a failure there is a failure everywhere
    (instead of the other ranks waiting forever at their next collective). Collective.

    ``work()``'s result on every rank (``work`` runs on rank 0 only). If it raises, rank 0
    re-raises it and every other rank raises ``RankZeroError`` naming ``what`` and the error."""
    payload, failure = None, None
    if is_rank_zero():
        try:
            payload = ("ok", work())
        except Exception as err:  # re-raised below, after the others have heard of it
            failure = err
            payload = ("error", f"{type(err).__name__}: {err}")
    payload = broadcast_object(payload)
    if failure is not None:
        raise failure
    if payload[0] == "error":
        raise RankZeroError(f"{what} failed on rank 0: {payload[1]}")
    return payload[1]
