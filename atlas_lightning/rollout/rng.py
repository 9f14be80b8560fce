"""``preserved_rng``: the process's global random states, kept across work that must not move them.

Validation's rollout (alone, or riding with a training rollout) runs inside it, so that validating
never shifts training's random draws: an engine may draw from the global generators (vLLM's
sampler does for a batch that mixes greedy requests with seeded ones), a validation's requests
must not change what training draws next.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch


@contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore the Python, numpy and torch (CPU and every initialised CUDA device) RNG states on
    exit, whatever ran inside."""
    python_state, numpy_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
