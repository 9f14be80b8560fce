"""Rank-0 work whose outcome every rank needs: run it on rank 0, broadcast the result, and make a
failure there a failure everywhere (instead of the other ranks waiting forever at their next
collective). Collective: every rank calls ``on_rank_zero`` at the same point."""

from __future__ import annotations

from typing import Callable, TypeVar

from atlas_lightning import distributed

T = TypeVar("T")


class RankZeroError(RuntimeError):
    """Raised on the other ranks when rank 0's part failed; names rank 0's error."""


def on_rank_zero(work: Callable[[], T], what: str) -> T:
    """``work()``'s result on every rank (``work`` runs on rank 0 only). If it raises, rank 0
    re-raises it and every other rank raises ``RankZeroError`` naming ``what`` and the error."""
    payload, failure = None, None
    if distributed.is_rank_zero():
        try:
            payload = ("ok", work())
        except Exception as err:  # re-raised below, after the others have heard of it
            failure = err
            payload = ("error", f"{type(err).__name__}: {err}")
    payload = distributed.broadcast_object(payload)
    if failure is not None:
        raise failure
    if payload[0] == "error":
        raise RankZeroError(f"{what} failed on rank 0: {payload[1]}")
    return payload[1]
