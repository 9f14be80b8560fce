"""Every random number generator a run draws from, per rank: what a checkpoint keeps of them.

What draws random numbers between two RL steps, and where its state lives:

* LoRA dropout (``model.lora.dropout`` > 0) in the update's forward passes: torch's global
  generator of the device that trains (the CPU's, or this rank's CUDA device's), seeded as a
  fresh run's first step starts (``seed_training``) with a seed of this rank's own, so that
  data-parallel ranks draw independent masks, and a rerun the same ones;
* anything else in the process that uses the global numpy or Python ``random`` generators
  (libraries included): kept too, so that nothing depends on whether they do.

What keeps no state across steps, so needs none here: the question sampler (a permutation drawn
from ``(data.seed, epoch)``, ``questions/sampler.py``; the data cursor says where it is), every
rollout request (its own seed, a function of the run seed, the step and the trajectory:
``rollout/datamodule.py``; the engines sample each request from a generator of that seed), the
memory check's synthetic batches (a generator of ``(seed, step, rank)``). Validation restores the
global generators after its rollout (``callbacks/validation.py``).

A rank's seed mixes the run's seed and the rank with numpy's ``SeedSequence``, as Lightning's
``pl_worker_init_function`` seeds a data loader's workers (not ``seed + rank``: rank 1 of seed 0
would draw what rank 0 of seed 1 draws). Only torch's generators are seeded, and after the
model's build, which forks them and draws from the run's seed alone (every rank builds the same
LoRA factors, ``models/actor_critic.py``); the rollout's requests keep their own seeds, numpy's
and Python's generators are left as they are, and a run without dropout draws nothing from
torch's.

The states are Lightning's own collection (``_collect_rng_states``/``_set_rng_states``: torch
CPU, every CUDA device torch sees where CUDA is available, numpy (its key array kept as a
tensor), Python), taken on every rank
and gathered to rank 0, which writes the checkpoint: ``{"world_size": W, "ranks": [state of
rank 0, ..., state of rank W-1]}`` under ``RNG_KEY``. ``restore`` gives each rank its own back.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states

from atlas_lightning import distributed as dist_utils

log = logging.getLogger(__name__)

#: The checkpoint's top-level entry (``run/resume_state.py`` refuses a state without it).
RNG_KEY = "rng_states"


def rank_seed(seed: int, rank: int) -> int:
    """Rank ``rank``'s 64-bit training seed in a run of seed ``seed`` (module doc): distinct for
    every rank, the same in every run of that seed."""
    import numpy as np

    return int(np.random.SeedSequence([int(seed), int(rank)]).generate_state(1, np.uint64)[0])


def seed_training(seed: int, rank: int) -> int:
    """Seed this process's torch generators (the CPU's and every CUDA device's) with
    ``rank_seed(seed, rank)``, and return it: what a fresh run's updates draw from (LoRA
    dropout). A resumed run sets its saved states instead (``restore``)."""
    chosen = rank_seed(seed, rank)
    torch.manual_seed(chosen)
    return chosen


def capture() -> Optional[dict]:
    """Every rank's generator states, in rank order, on rank 0 (None elsewhere). Collective."""
    mine = _collect_rng_states(include_cuda=torch.cuda.is_available())
    mine["numpy"] = _numpy_as_tensors(mine["numpy"])
    ranks = dist_utils.gather_objects(mine)
    return None if ranks is None else {"world_size": len(ranks), "ranks": ranks}


def restore(entry: dict) -> None:
    """Set this rank's generators to its state in ``entry`` (``capture``'s). A run resumed at
    another world size cannot continue every rank's draws: ranks the checkpoint did not have
    keep their own state, and a warning says so."""
    rank, world = dist_utils.rank(), dist_utils.world_size()
    saved = entry["ranks"]
    if len(saved) != world and rank == 0:
        log.warning("the checkpoint holds the RNG states of %d rank(s) and this run has %d: the random draws "
                    "(LoRA dropout) do not continue those of the checkpointed run exactly", len(saved), world)
    if rank < len(saved):
        state = _own_cuda_count(saved[rank])
        _set_rng_states({**state, "numpy": _numpy_from_tensors(state["numpy"])})


def check(entry: Any) -> None:
    """Every rank's states in ``entry`` (a checkpoint's ``RNG_KEY`` value) can be set: each is
    set on a generator of its own (a new torch ``Generator``, numpy ``RandomState`` and Python
    ``Random``), never on this process's; CUDA's must be byte tensors (a machine without the
    card cannot try them). ``ValueError`` naming the rank and the generator otherwise: ``restore``
    would fail on it, or on another rank, only once training has started."""
    import random

    import numpy as np

    ranks = entry.get("ranks") if isinstance(entry, dict) else None
    if not isinstance(ranks, (list, tuple)):
        raise ValueError("the random generator states are not a list of every rank's")
    tries = {"torch": lambda s: torch.Generator().set_state(s),
             "numpy": lambda s: np.random.RandomState().set_state(_numpy_from_tensors(s)),
             "python": lambda s: random.Random().setstate(s)}
    for rank, state in enumerate(ranks):
        if not isinstance(state, dict):
            raise ValueError(f"rank {rank}'s generator states are a {type(state).__name__}, not a dict")
        for part, set_state in tries.items():
            try:
                set_state(state[part])
            except Exception as err:  # whatever the generator raises for a state it cannot take
                raise ValueError(f"rank {rank}'s {part} generator state cannot be set ({type(err).__name__}: "
                                 f"{' '.join(str(err).split())[:200]})") from None
        cuda = state.get("torch.cuda")
        if cuda is not None and not (isinstance(cuda, (list, tuple)) and all(
                isinstance(s, torch.Tensor) and s.dtype == torch.uint8 for s in cuda)):
            raise ValueError(f"rank {rank}'s CUDA generator states are not byte tensors")


def _numpy_as_tensors(state: tuple) -> tuple:
    """numpy's ``get_state()`` with its key array as a torch tensor: Lightning loads a resumed
    state with ``weights_only`` torch.load, which refuses numpy arrays."""
    kind, keys, *rest = state
    return (kind, torch.from_numpy(keys.astype("int64")), *rest)


def _numpy_from_tensors(state: tuple) -> tuple:
    import numpy as np

    kind, keys, *rest = state
    return (kind, keys.numpy().astype(np.uint32), *rest)


def _own_cuda_count(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` without CUDA states this process cannot set (a checkpoint of a CUDA run resumed
    where CUDA is absent, or sees fewer devices)."""
    cuda = state.get("torch.cuda")
    if cuda is None:
        return state
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if len(cuda) == count:
        return state
    trimmed = dict(state)
    if count == 0 or len(cuda) < count:
        trimmed.pop("torch.cuda")
    else:
        trimmed["torch.cuda"] = list(cuda)[:count]
    return trimmed
