"""Which questions each RL step samples: a pure function of (seed, step), so a resumed run
samples exactly what an uninterrupted one would and every rank agrees without talking.

Epoch ``e`` is a permutation of all training questions drawn from ``numpy``'s PCG64 seeded
with ``(seed, e)`` (identity order when shuffling is off); step ``k`` takes the
``train_batch_size`` questions at positions ``[i * B, (i + 1) * B)`` of epoch ``k // S``,
``i = k % S``, with ``S = N // B`` steps an epoch (the last partial batch is dropped, as
verl's loader does).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class QuestionSampler:
    num_questions: int
    batch_size: int
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.batch_size <= 0:
            raise ValueError(f"train_batch_size must be positive, got {self.batch_size}")
        if self.num_questions < self.batch_size:
            raise ValueError(
                f"{self.num_questions} training questions cannot fill one batch of "
                f"train_batch_size={self.batch_size}"
            )

    @property
    def steps_per_epoch(self) -> int:
        return self.num_questions // self.batch_size

    def epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_questions)
        return np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(self.num_questions)

    def step_indices(self, step: int) -> list[int]:
        """Indices (into the training question list) of RL step ``step``'s questions."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, within = divmod(step, self.steps_per_epoch)
        order = self.epoch_order(epoch)
        return order[within * self.batch_size:(within + 1) * self.batch_size].tolist()


def sampling_digest(questions: list, sampler: QuestionSampler, samples: int) -> str:
    """sha256 of what decides every step's trajectories: the training questions in order (each
    row's every field), the sampler's settings and the samples a question. A checkpoint's data
    cursor keeps it, so that a resume on other data or other sampling settings is refused
    (``run/resume_state.py``) rather than continued from a cursor into another sequence."""
    import hashlib

    digest = hashlib.sha256(repr((sampler.batch_size, sampler.seed, sampler.shuffle, samples)).encode())
    for question in questions:
        digest.update(repr(question).encode())
    return digest.hexdigest()


def shard(items: list, rank: int, world_size: int) -> list:
    """Contiguous share of ``items`` for ``rank``; sizes differ by at most one."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of size {world_size}")
    base, extra = divmod(len(items), world_size)
    start = rank * base + min(rank, extra)
    return items[start:start + base + (1 if rank < extra else 0)]
