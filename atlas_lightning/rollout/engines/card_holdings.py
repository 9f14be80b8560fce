"""What holds a card's memory, for an engine that could not map its own back (``wake_up``).

vLLM maps its weights and KV cache outside PyTorch's caching allocator, so a wake fails with
the driver's bare "CUDA Error: out of memory" when the trainer's live tensors (not its cache,
which ``wake_up`` returns first) leave too little room. ``summary`` is cheap (the driver's free
memory and the allocator's counters) and is logged at every wake; ``largest_live`` walks the
garbage collector's objects and is built only for the error, to name what stayed alive.
"""

from __future__ import annotations

import gc
import warnings
from collections import Counter
from typing import Iterator

import torch

_GIB = 1024 ** 3


def summary(device: torch.device, engine_bytes: int = 0) -> str:
    """The card's free memory and what PyTorch holds on it (allocated, cached), in GiB.
    ``engine_bytes``: what the engine allocated through PyTorch at its start (its memory pool,
    counted as allocated even while asleep and unmapped), told apart from the trainer's."""
    free, total = torch.cuda.mem_get_info(device)
    allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    engine = min(max(engine_bytes, 0), allocated)
    return (f"card {free / _GIB:.2f} GiB free of {total / _GIB:.2f}; PyTorch holds {(allocated - engine) / _GIB:.2f} GiB "
            f"in the trainer's live tensors" + (f" and {engine / _GIB:.2f} GiB of the engine's own" if engine else "")
            + f", {(reserved - allocated) / _GIB:.2f} GiB more cached")


def storages(device: torch.device) -> set[int]:
    """The data pointers of every live tensor's storage on ``device``: taken at an engine's start,
    they are the engine's, for ``largest_live`` to leave out."""
    return {pointer for _, pointer, _ in _live_tensors(device)}


def largest_live(device: torch.device, top: int = 6, floor_mib: int = 64, exclude: frozenset[int] = frozenset()) -> str:
    """The live tensors on ``device`` of at least ``floor_mib`` MiB, grouped by dtype and shape,
    largest total first (parameters and their gradients included), but those whose storage is in
    ``exclude`` (``storages``: the engine's own)."""
    groups: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for tensor, pointer, nbytes in _live_tensors(device):
        size = 0 if pointer in exclude else nbytes
        if size >= floor_mib * 1024 ** 2:
            key = f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}{' param' if isinstance(tensor, torch.nn.Parameter) else ''}"
            groups[key] += size
            counts[key] += 1
    if not groups:
        return f"no live tensor of {floor_mib} MiB or more"
    return "largest live tensors: " + ", ".join(f"{counts[k]} x {k} = {v / _GIB:.2f} GiB"
                                                for k, v in groups.most_common(top))


def _live_tensors(device: torch.device) -> Iterator[tuple[torch.Tensor, int, int]]:
    """Every tensor the garbage collector knows on ``device``, with its storage's data pointer
    and size in bytes."""
    with warnings.catch_warnings():  # the walk touches deprecated module attributes, which warn
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if not isinstance(obj, torch.Tensor) or obj.device != device:
                    continue
                storage = obj.untyped_storage()
                pointer, nbytes = storage.data_ptr(), int(storage.nbytes())
            except Exception:  # proxies, half-built objects and symbolic (fake) tensors, which have no data
                continue
            yield obj, pointer, nbytes
