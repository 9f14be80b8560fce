"""The PPO step's metrics, as functions of what the step computed (verl's ``metric_utils`` beside the step).

Each function takes the step's tensors and returns ``{name: float}``; none keeps state. Where
a figure is over the whole batch of every rank the function reduces over the ranks itself
(collective: every rank calls it, with the same keys) and says so.

Shapes: ``bs`` is this rank's trajectory count, ``width`` the batch's longest response; every
per-token tensor is ``(bs, width)``, zero past a trajectory's response, and ``mask`` is 1 on
the tokens the policy generated.

- ``data_metrics``: verl's data metrics (scores, rewards, advantages, returns, values, entropy,
  throughput), the rollout's reward and batch metrics (``combine_batch_metrics``), timing and
  the rollout's weights version and staleness, and the separate layout's staleness histogram
  and idle shares (``asynchronous_metrics``);
- ``mean_over_ranks``: verl's reduction of the update metrics (``ROLE_METRICS``);
- ``memory_metrics``: the step's per-phase memory peaks, the trainer's own (``timed``
  measures them);
- ``per_trajectory``: the step's tensors cut to each trajectory's response (``StepOutput.tensors``).

Who calls it: ``ppo/module.py`` (the step), tests.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Optional

import numpy as np
import torch

from atlas_lightning import distributed as dist_utils
from atlas_lightning.rollout.batch import RolloutBatch

#: The per-micro-batch metrics of each role, in a fixed order (every rank reduces the same list).
ROLE_METRICS = {
    "actor": ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "actor/grad_norm"),
    "critic": ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm"),
}
#: The actor's extra metrics under ``algorithm.off_policy_loss=decoupled``
#: (``algorithms.ppo.behaviour_importance_weights``).
BEHAVIOUR_METRICS = ("actor/behav_imp_weight_mean", "actor/behav_capped_frac", "actor/behav_kl")


@contextmanager
def timed(timing: dict, name: str, memory: Optional[dict] = None):
    """Seconds of the block into ``timing[name]``; on CUDA with ``memory`` given, also the
    block's peak of PyTorch's allocated and reserved memory in GiB
    (``memory["peak_allocated_gib/<name>"]``, ``memory["peak_reserved_gib/<name>"]``; the
    counters are reset when the block starts, and the device is synchronised at both ends so
    that the seconds are the phase's own)."""
    cuda = memory is not None and torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.monotonic()
    yield
    if cuda:
        torch.cuda.synchronize()
        for key, value in (("peak_allocated_gib", torch.cuda.max_memory_allocated()),
                           ("peak_reserved_gib", torch.cuda.max_memory_reserved())):
            memory[f"{key}/{name}"] = max(memory.get(f"{key}/{name}", 0.0), value / 2**30)
    timing[name] = timing.get(name, 0.0) + time.monotonic() - start


def data_metrics(batch: RolloutBatch, *, mask: torch.Tensor, values: torch.Tensor, returns: torch.Tensor,
                 advantages: torch.Tensor, old_log_prob: torch.Tensor, scores: torch.Tensor, rewards: torch.Tensor,
                 entropy: Optional[torch.Tensor], timing: dict) -> dict[str, float]:
    """verl's data metrics over the whole batch (all ranks), plus reward fields and timing.
    Every tensor is ``(bs, width)`` on one device: ``mask``, ``values`` (critic), ``returns``,
    ``advantages`` (as the update used them), ``old_log_prob`` (actor, before the update),
    ``scores`` (the token rewards), ``rewards`` (as GAE saw them: the KL penalty in when on),
    ``entropy`` (None when not computed). ``timing``: the step's seconds by phase
    (``timing["step"]`` is the step's wall time). Collective."""
    n = float(len(batch))
    token_sum = float(mask.sum())
    seq_scores = scores.sum(-1)
    seq_rewards = rewards.sum(-1)
    rollout_log_prob = batch.padded("response_logprobs").to(mask.device)
    sums = dist_utils.all_reduce_sum([
        n, token_sum, float(seq_scores.sum()), float(seq_rewards.sum()),
        float((advantages * mask).sum()), float((returns * mask).sum()), float((values * mask).sum()),
        float((entropy * mask).sum()) if entropy is not None else 0.0,
        float(sum(batch.sequence_lengths())),
        float(((old_log_prob - rollout_log_prob).abs() * mask).sum()),
    ])
    n_all, tokens_all = max(sums[0], 1.0), max(sums[1], 1.0)
    world = dist_utils.world_size()
    out = {
        "critic/score/mean": sums[2] / n_all,
        "critic/rewards/mean": sums[3] / n_all,
        "critic/advantages/mean": sums[4] / tokens_all,
        "critic/returns/mean": sums[5] / tokens_all,
        "critic/values/mean": sums[6] / tokens_all,
        "actor/entropy": sums[7] / tokens_all,
        "rollout/logprob_diff_mean": sums[9] / tokens_all,
        "perf/total_num_tokens": sums[8],
        "perf/trajectories": sums[0],
        "perf/throughput": sums[8] / max(timing.get("step", 1e-9), 1e-9) / world,
        "training/rl_step": float(batch.step),
    }
    # Reward means and batch-level metrics: averaged over ranks weighted by trajectories.
    gathered = dist_utils.gather_objects((len(batch), batch.metrics(), batch.invariants))
    if gathered is not None:
        out.update(combine_batch_metrics(gathered))
    out = dist_utils.broadcast_object(out)
    out.update({f"timing_s/{k}": float(v) for k, v in timing.items()})
    out["rollout/weights_version"] = float(batch.weights_version if batch.weights_version is not None else -1)
    if batch.staleness is not None:  # versions the rollout lags the trained policy (README, "The separate layout")
        out["rollout/staleness"] = float(dist_utils.all_reduce_max([float(batch.staleness)])[0])
    out.update(asynchronous_metrics(batch, timing))
    out["rollout/gen_tokens_per_s"] = batch.stats.tokens_per_second
    return out


def asynchronous_metrics(batch: RolloutBatch, timing: dict) -> dict[str, float]:
    """The separate layout's figures of a step; nothing in synchronous layouts, whose batches
    carry no staleness histogram. Collective (every rank of a separate layout has one).

    ``rollout/staleness_hist/<k>``: the step's trajectories (all ranks) whose oldest generated
    token is ``k`` versions behind the trained weights, k = 0 .. ``layout.max_staleness``;
    ``rollout/staleness_mean``; ``rollout/dropped_trajectories`` (over the bound, ``drop``);
    ``perf/trainer_idle_share``: the step's wait for its rollout over its wall time (the most
    idle rank); ``perf/engine_idle_share``: the producer's wait (for weights or room) over that
    wait plus its rollout, on the least idle rank: the one shared server idles at most that.
    With partial rollouts, ``rollout/reprefill_tokens``: the tokens prefilled again to continue
    the turns weight syncs interrupted (all ranks; their seconds are ``timing_s/reprefill``)."""
    if not batch.staleness_counts:
        return {}
    keys = sorted(batch.staleness_counts)
    counts = dist_utils.all_reduce_sum([float(batch.staleness_counts[k]) for k in keys] + [float(batch.dropped)])
    idle = float(timing.get("engine_idle", 0.0))
    trainer_idle, engine_busy = dist_utils.all_reduce_max([
        float(timing.get("wait_rollout", 0.0)) / max(float(timing.get("step", 0.0)), 1e-9),
        1.0 - idle / max(idle + float(timing.get("rollout", 0.0)), 1e-9)])
    out = {f"rollout/staleness_hist/{k}": c for k, c in zip(keys, counts)}
    out["rollout/staleness_mean"] = sum(k * c for k, c in zip(keys, counts)) / max(sum(counts[:-1]), 1.0)
    out["rollout/dropped_trajectories"] = counts[-1]
    out["perf/trainer_idle_share"] = trainer_idle
    out["perf/engine_idle_share"] = 1.0 - engine_busy
    if batch.stats.reprefill_tokens is not None:  # partial rollouts (every rank alike)
        out["rollout/reprefill_tokens"] = dist_utils.all_reduce_sum([float(batch.stats.reprefill_tokens)])[0]
    return out


def cost_metrics(step_seconds: float, cards: int, gpu_hour_usd: float, trajectories: float,
                 explore_usd_per_trajectory: Optional[float]) -> dict[str, float]:
    """What the step cost in cards, beside what its explores cost (the reward's dollars):
    ``cost/gpu_seconds`` (the step's wall time x every card the run holds, serving cards
    included), ``cost/gpu_usd`` at ``gpu_hour_usd`` a card-hour (``trainer.gpu_hour_usd``), both
    per trajectory too, and ``cost/explore_usd`` (the dollars the step's explores revealed, the
    reward's ``cost_total`` summed over every trajectory) with its per-trajectory mean."""
    gpu_seconds = float(step_seconds) * int(cards)
    gpu_usd = gpu_seconds / 3600.0 * float(gpu_hour_usd)
    n = max(float(trajectories), 1.0)
    out = {"cost/gpu_seconds": gpu_seconds, "cost/gpu_usd": gpu_usd,
           "cost/gpu_seconds_per_trajectory": gpu_seconds / n, "cost/gpu_usd_per_trajectory": gpu_usd / n}
    if explore_usd_per_trajectory is not None:
        out["cost/explore_usd_per_trajectory"] = float(explore_usd_per_trajectory)
        out["cost/explore_usd"] = float(explore_usd_per_trajectory) * n
    return out


def combine_batch_metrics(gathered: list) -> dict[str, float]:
    """Rank 0's merge of every rank's ``(trajectories, RolloutBatch.metrics(), invariants rows)``:
    trajectory-weighted means, maxima where the name says so (``*_max``, ``*/max``; the largest
    magnitude for ``*events_max``), invariants recomputed over all trajectories."""
    from atlas_lightning.reward import batch_invariants

    total = sum(n for n, _, _ in gathered) or 1
    out: dict[str, float] = {}
    keys = set().union(*(m.keys() for _, m, _ in gathered))
    for key in keys:
        values = [(n, m[key]) for n, m, _ in gathered if key in m]
        if key.endswith("_max") or key.endswith("/max"):
            out[key] = max((v for _, v in values), key=abs if key.endswith("events_max") else None)
        else:
            out[key] = sum(n * v for n, v in values) / total
    out.update(batch_invariants([row for _, _, rows in gathered for row in rows]))
    return out


def mean_over_ranks(history: dict[str, list[float]]) -> dict[str, float]:
    """verl's reduction: the mean of every value each rank recorded (micro-batches, optimizer
    steps), over all ranks; 0.0 for a key no rank recorded. Collective; the keys must be the
    same on every rank."""
    keys = list(history)
    totals = dist_utils.all_reduce_sum([float(sum(history[k])) for k in keys] + [float(len(history[k])) for k in keys])
    return {k: (totals[i] / totals[len(keys) + i] if totals[len(keys) + i] else 0.0) for i, k in enumerate(keys)}


def memory_metrics(phases: dict[str, float], rollout: dict[str, float]) -> dict[str, float]:
    """``memory/<key>``: the step's per-phase peaks (``phases``, GiB, from ``timed``) and the
    rollout's card figures (``rollout``, ``RolloutBatch.memory``), each the maximum over ranks
    (collective: every rank has the same keys, the same phases having run).

    The peaks are the trainer's: PyTorch's counters less ``rollout["engine_allocated_gib"]``, the
    colocated engine's weights and KV cache, which PyTorch counts as allocated even while the
    engine sleeps (vLLM's memory pool keeps its addresses; seen on the H200: a 0.3-utilisation
    engine's 41.9 GiB in every update phase of a model of a few MB). That is what ``plan``'s
    tensors predict."""
    engine = float(rollout.get("engine_allocated_gib", 0.0))
    trainer = {k: max(v - engine, 0.0) if k.startswith(("peak_allocated_gib/", "peak_reserved_gib/")) else v
               for k, v in phases.items()}
    keys = sorted(set(trainer) | set(rollout))
    if not keys:
        return {}
    values = dist_utils.all_reduce_max([trainer.get(k, rollout.get(k, 0.0)) for k in keys])
    return {f"memory/{k}": v for k, v in zip(keys, values)}


def per_trajectory(batch: RolloutBatch, **tensors: Optional[torch.Tensor]) -> dict[str, list[np.ndarray]]:
    """Each ``(bs, width)`` tensor of ``tensors`` (None: left out) as one 1-D float32 array per
    trajectory of ``batch.records``, as long as that trajectory's response."""
    out = {}
    lengths = [len(r.response_ids) for r in batch.records]
    for name, tensor in tensors.items():
        if tensor is None:
            continue
        cpu = tensor.detach().float().cpu().numpy()
        out[name] = [cpu[i, :n].astype(np.float32) for i, n in enumerate(lengths)]
    return out
