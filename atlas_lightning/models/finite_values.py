"""How many values of a tensor are NaN or infinite: the one count of the start-up checks that read
tensors from files (a base's weights, ``run/base_values.py``; an adapter folder,
``models/adapters.read_adapter_folder``; a resume state, ``run/resume_tensors.refuse_nonfinite``)."""

from __future__ import annotations

from typing import Any

import torch

#: Values counted at a time: a bool mask of a whole embedding would double what a check holds.
CHUNK = 1 << 24


def nonfinite_counts(tensor: Any) -> tuple[int, int]:
    """``(NaN values, infinite values)`` of a floating tensor; ``(0, 0)`` for anything else. One
    ``torch.aminmax`` pass decides first (NaN and inf propagate into its two values, at memory
    speed, where ``torch.isfinite`` on a bf16 tensor is about 25 times slower on a CPU); only a
    tensor that has some is counted, in chunks of ``CHUNK`` values."""
    if not torch.is_tensor(tensor) or not tensor.is_floating_point() or not tensor.numel():
        return 0, 0
    low, high = torch.aminmax(tensor.detach())
    if bool(torch.isfinite(low) and torch.isfinite(high)):
        return 0, 0
    nans = infs = 0
    for chunk in tensor.detach().reshape(-1).split(CHUNK):
        chunk = chunk.float()
        nans += int(torch.isnan(chunk).sum())
        infs += int(torch.isinf(chunk).sum())
    return nans, infs
