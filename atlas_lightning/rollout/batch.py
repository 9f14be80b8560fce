"""``RolloutBatch``: what one RL step's rollout hands the trainer, and how it is assembled.

One batch holds this rank's trajectories of one step: their records (README, "On-disk layout", with the
per-token arrays attached), the token-level rewards placed by ``atlas_lightning.reward``, the
reward invariants, the loop's statistics and the weights version the engine served while
sampling (``weights_version``: the on-policy check reads it).

``padded`` turns the ragged per-token arrays into verl's right-padded ``(bs, response_length)``
tensors, with ``response_length`` the longest response of this batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from atlas_lightning import reward as reward_lib
from atlas_lightning.store.records import TrajectoryRecord, build_record
from atlas_lightning.rollout.agent_loop import LoopStats, Trajectory


def session_id(sample_index: int) -> str:
    return f"n{sample_index:03d}"


@dataclass
class RolloutBatch:
    step: int
    partition: str
    records: list[TrajectoryRecord]
    #: float32 ``(len(response_ids),)`` per trajectory, the reward on each response token.
    token_rewards: list[np.ndarray]
    #: ``reward.trajectory_invariants`` of each trajectory, taken on its ``token_rewards`` array.
    invariants: list[dict]
    stats: LoopStats
    weights_version: Optional[int] = None
    timing: dict = field(default_factory=dict)
    #: Versions the weights it was sampled with lag the trainer's when it is trained on
    #: (set at hand-over: 0 in synchronous layouts, at most ``layout.max_staleness`` otherwise).
    staleness: Optional[int] = None
    #: GiB figures of the rollout on this rank's card (GPUs only; logged as ``memory/<key>``):
    #: ``card_used_gib/gen`` at the end of generation, ``card_used_gib/asleep`` after the sleep
    #: (each beside ``torch_reserved_gib/*`` and ``torch_allocated_gib/*``, this process's
    #: PyTorch allocator then, less the engine's pool), ``engine_allocated_gib`` what PyTorch
    #: counts as allocated for the engine (asleep or not).
    memory: dict = field(default_factory=dict)
    #: Asynchronous layout, set at hand-over: trajectories by how many versions their oldest
    #: generated token lags the trainer's weights (``{k: count}``, k = 0 .. ``layout.max_staleness``),
    #: and how many were dropped over that bound (``layout.staleness_policy=drop``). Empty and 0
    #: in synchronous layouts.
    staleness_counts: dict = field(default_factory=dict)
    dropped: int = 0

    def __len__(self) -> int:
        return len(self.records)

    def subset(self, indices: list[int]) -> "RolloutBatch":
        """The trajectories at ``indices`` (e.g. one data-parallel rank's share)."""
        return RolloutBatch(step=self.step, partition=self.partition,
                            records=[self.records[i] for i in indices],
                            token_rewards=[self.token_rewards[i] for i in indices],
                            invariants=[self.invariants[i] for i in indices], stats=self.stats,
                            weights_version=self.weights_version, timing=dict(self.timing),
                            staleness=self.staleness, memory=dict(self.memory),
                            staleness_counts=dict(self.staleness_counts), dropped=self.dropped)

    def oldest_versions(self) -> list[Optional[int]]:
        """Each trajectory's oldest weights version among its generated tokens (its record's
        ``response_versions``), or the batch's ``weights_version`` where a record has none."""
        out = []
        for record in self.records:
            versions, mask = record.response_versions, record.response_mask
            known = versions[(mask == 1) & (versions >= 0)] if versions is not None and mask is not None else ()
            out.append(int(known.min()) if len(known) else self.weights_version)
        return out

    def sequence_lengths(self) -> list[int]:
        return [len(r.prompt_ids) + len(r.response_ids) for r in self.records]

    def padded(self, name: str, dtype: torch.dtype = torch.float32, pad: float = 0) -> torch.Tensor:
        """``(bs, max_response_len)`` tensor of a response array (``response_ids``,
        ``response_mask``, ``response_logprobs``) or ``token_rewards``, right-padded with ``pad``."""
        arrays = self.token_rewards if name == "token_rewards" else [getattr(r, name) for r in self.records]
        width = max((len(a) for a in arrays), default=0)
        out = torch.full((len(arrays), width), pad, dtype=dtype)
        for i, array in enumerate(arrays):
            out[i, : len(array)] = torch.as_tensor(np.asarray(array), dtype=dtype)
        return out

    def metrics(self) -> dict[str, float]:
        """Reward means, the two invariants, response lengths and turn counts of this batch."""
        out = reward_lib.reward_means([r.reward for r in self.records])
        out.update(reward_lib.batch_invariants(self.invariants))
        lengths = np.array([len(r.response_ids) for r in self.records], dtype=np.float64)
        generated = np.array([int(np.sum(r.response_mask)) for r in self.records], dtype=np.float64)
        if len(lengths):
            out["response_length/mean"] = float(lengths.mean())
            out["response_length/max"] = float(lengths.max())
            out["response_length/generated_mean"] = float(generated.mean())
            out["num_turns/mean"] = float(np.mean([r.num_turns for r in self.records]))
        return out


def assemble_batch(
    trajectories: list[Trajectory],
    *,
    step: int,
    partition: str,
    run_id: str,
    scorer: reward_lib.RewardScorer,
    stats: LoopStats,
    weights_version: Optional[int],
) -> RolloutBatch:
    """Score every ended episode with ``scorer`` (the run's reward, ``reward/scorer.py``: its
    contract, and the token rewards and invariants derived here) and build its record. Refuses
    an unfinished trajectory: a step with missing trajectories is never recorded as complete."""
    records, rewards, invariants = [], [], []
    for traj in trajectories:
        if not traj.done:
            raise RuntimeError(f"trajectory {traj.uid}/{traj.session_id} did not finish; the step is not recorded")
        episode = traj.episode.to_record_episode()
        scored = reward_lib.score_trajectory(scorer, episode, len(traj.response_ids),
                                             where=f"trajectory {traj.uid}/{traj.session_id} of step {step}")
        # float32: the very array PPO receives (``padded`` copies it); the invariants were taken on it
        dense = scored.token_rewards
        invariants.append(scored.invariants)
        question = traj.episode.question
        records.append(build_record(
            episode, {"reward": scored.reward, "reward_trace": scored.reward_trace},
            run_id=run_id, partition=partition, global_steps=step,
            uid=traj.uid, session_id=traj.session_id, ground_truth=question.ground_truth,
            data_source=question.data_source, attempt_id=traj.attempt_id,
            extra={"subsets": dict(question.subsets)} if question.subsets else None,
            prompt_ids=np.asarray(traj.prompt_ids, dtype=np.int64),
            response_ids=np.asarray(traj.response_ids, dtype=np.int64),
            response_mask=np.asarray(traj.response_mask, dtype=np.int8),
            response_logprobs=np.asarray(traj.response_logprobs, dtype=np.float32),
            **_versions(traj),
        ))
        rewards.append(dense)
    return RolloutBatch(step=step, partition=partition, records=records, token_rewards=rewards,
                        invariants=invariants, stats=stats, weights_version=weights_version)


def _versions(traj: Trajectory) -> dict:
    """``response_versions`` of a trajectory the agent loop drove (one version a response
    token); nothing for one built by hand without them."""
    if not traj.response_versions and traj.response_ids:
        return {}
    return {"response_versions": np.asarray(traj.response_versions, dtype=np.int64)}
