"""A user's own reward scorer and callback that raise part-way through a fit (``tests/e2e/test_faults.py``),
named by ``reward._target_`` and ``callbacks.<name>._target_`` as a user's code would be."""

from __future__ import annotations

import lightning as L

from atlas_lightning.reward.scorer import CostReward


class RaisingReward(CostReward):
    """The package's scorer until RL step ``step``'s rollout, whose first trajectory it refuses:
    ``ValueError`` (the trajectories a step scores: ``trajectories_per_step``)."""

    def __init__(self, cost_per_usd: float, no_submit_reward: float = 0.0, step: int = 1,
                 trajectories_per_step: int = 1) -> None:
        super().__init__(cost_per_usd, no_submit_reward)
        self.first_failing_call = (step - 1) * trajectories_per_step + 1
        self.calls = 0

    def __call__(self, episode):
        self.calls += 1
        if self.calls >= self.first_failing_call:
            raise ValueError(f"user reward refused an episode ({episode.get('terminal_reason')})")
        return super().__call__(episode)


class RaisingCallback(L.Callback):
    """Raises ``RuntimeError`` as RL step ``step`` starts."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch.step == self.step:
            raise RuntimeError(f"user callback failed at RL step {batch.step}")
