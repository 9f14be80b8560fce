"""Token-budget micro-batching of a PPO mini-batch, on one card and across data-parallel ranks.

A mini-batch's sequences (prompt + response tokens each, packed without padding) are split
into micro-batches whose token sums stay within a per-card budget
(``algorithm.ppo_max_token_len_per_gpu`` for backward passes, ``forward_max_token_len_per_gpu``
for forward-only ones). verl does this with Karmarkar-Karp
(``verl/utils/seqlen_balancing.py``); here it is a bin-packing search with these guarantees:

* Every sequence index appears in exactly one micro-batch; nothing is dropped or split.
* Every micro-batch's token sum is <= the budget. A sequence longer than the budget is an
  error (``ValueError`` naming it) unless ``allow_oversized=True``, in which case it is put
  alone in its own micro-batch and listed in ``oversized``: the trainer must never silently
  drop tokens, and it decides whether such a pass may exceed the budget.
* Fewest micro-batches within reach: for k = ceil(total / budget), k + 1, ... the sequences
  are spread over k micro-batches longest-first (LPT), overflowing ones are repaired by
  moves/swaps into micro-batches with room, and the first k that fits is taken; if none
  below first-fit-decreasing's count fits, FFD's packing is used. So the count is at
  least the lower bound ceil(total / budget) and at most FFD's (<= 11/9 OPT + 6/9); in
  trials with hundreds of sequences under a 49,152-token budget it met the lower bound.
* Balanced: the heaviest micro-batch then gives a sequence to (or swaps one with) the
  lightest micro-batch that can take one while the heaviest gets lighter; the budget is
  never exceeded by this step.
* Deterministic: a pure function of its inputs; ties go to the lower index. Micro-batches
  are ordered heaviest first, and indices inside one ascend.

Data parallelism (``plan_data_parallel``): the mini-batch is first split over ranks balanced
by tokens, then every rank gets the SAME number of micro-batches (the largest any rank
needs), because each FSDP forward/backward is a collective that all ranks must enter
together. A rank that has fewer sequences than that count gets empty micro-batches (``()``),
on which it must still run a forward/backward (a one-token dummy with loss weight 0).

Loss scaling (``token_mean_weights``): weight = loss tokens in the micro-batch / loss tokens
in the whole mini-batch on all ranks, so that sum over ranks and micro-batches of weight x
(token-mean loss of the micro-batch) is the token-mean over the mini-batch. Under FSDP/DDP,
which average gradients over ranks, backpropagate ``world_size * weight * micro_loss`` (the
same as ``ppo.agg_loss(..., dp_size=world_size, batch_num_tokens=total)``).

Padded layouts (``plan_padded_micro_batches``): a model whose recurrent layers cannot see
packed sequence boundaries (Qwen3.5/3.6 in transformers 5.17-5.19, ``ActorCritic``'s
``padded`` layout) runs a micro-batch of ``n`` sequences as ``(n, longest)``; what it costs,
and what the budget must bound, is ``n x longest``, not the sum of lengths. There the
sequences are sorted longest first and cut greedily into runs: each micro-batch starts with
the longest sequence left and takes the next ones while ``count x that length`` fits. This
gives the fewest micro-batches for that cost (an exchange argument: some optimal plan puts
the ``floor(budget / longest)`` longest sequences together, and so on recursively; the tests
check it against exhaustive search) and groups similar lengths, so little is padding.

Who calls it: the PPO step (``ppo/module.py``) for every mini-batch; the memory planner.
Pure Python; no torch.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "DataParallelPlan",
    "MicroBatchPlan",
    "plan_data_parallel",
    "plan_micro_batches",
    "plan_padded_micro_batches",
    "token_mean_weights",
]


@dataclass(frozen=True)
class MicroBatchPlan:
    """Micro-batches of one card: indices into the caller's list of sequences.

    ``micro_batches[m]``: ascending sequence indices of micro-batch m (``()`` for a padding
    micro-batch); ``token_sums[m]``: its tokens; ``oversized``: indices longer than the
    budget, each alone in its micro-batch (only with ``allow_oversized``).
    """

    micro_batches: tuple[tuple[int, ...], ...]
    token_sums: tuple[int, ...]
    oversized: tuple[int, ...]
    max_token_len: int

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batches)


@dataclass(frozen=True)
class DataParallelPlan:
    """A mini-batch spread over ``world_size`` ranks, the same micro-batch count on each.

    ``micro_batches[r][m]``: ascending indices into the *mini-batch* (not the rank) of
    micro-batch m on rank r; ``token_sums[r][m]`` its tokens; ``rank_indices[r]`` all of
    rank r's indices (ascending); ``oversized`` as in ``MicroBatchPlan``.
    """

    rank_indices: tuple[tuple[int, ...], ...]
    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    token_sums: tuple[tuple[int, ...], ...]
    oversized: tuple[int, ...]
    max_token_len: int

    @property
    def world_size(self) -> int:
        return len(self.rank_indices)

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batches[0]) if self.micro_batches else 0


# ----------------------------------------------------------------------------- public


def plan_micro_batches(
    seq_lens: Sequence[int],
    max_token_len: int,
    *,
    num_micro_batches: int | None = None,
    allow_oversized: bool = False,
) -> MicroBatchPlan:
    """Split sequences of ``seq_lens`` tokens into micro-batches of at most ``max_token_len`` tokens.

    ``num_micro_batches=None`` asks for the fewest micro-batches (see the module doc);
    a number asks for exactly that many, padding with empty micro-batches when there are
    fewer sequences (it must be at least the fewest count: ``ValueError`` otherwise).
    """
    lengths = _check_lengths(seq_lens)
    budget = _check_budget(max_token_len)
    oversized = _oversized(lengths, budget, allow_oversized)
    oversized_set = set(oversized)
    regular = [i for i in range(len(lengths)) if i not in oversized_set]

    fewest = _fewest_bins(regular, lengths, budget)
    if num_micro_batches is None:
        bins = fewest
    else:
        wanted = num_micro_batches - len(oversized)
        if wanted < len(fewest):
            raise ValueError(
                f"plan_micro_batches: num_micro_batches={num_micro_batches} is too few; "
                f"{len(fewest) + len(oversized)} are needed for {len(lengths)} sequences "
                f"({sum(lengths)} tokens) under max_token_len={budget}"
            )
        bins = _exactly_k_bins(regular, lengths, budget, wanted, fewest)
    bins = bins + [[i] for i in oversized]
    return _finish(bins, lengths, oversized, budget)


def plan_padded_micro_batches(
    seq_lens: Sequence[int],
    max_token_len: int,
    *,
    num_micro_batches: int | None = None,
    allow_oversized: bool = False,
) -> MicroBatchPlan:
    """Micro-batches for a right-padded layout, where ``n`` sequences cost ``n x longest`` tokens.

    Same contract as ``plan_micro_batches`` (every index once; ``num_micro_batches`` asks for
    exactly that many, empty ones padding; oversized sequences alone, or an error), except
    that ``token_sums[m]`` is the padded size ``len(micro_batch) x its longest sequence``,
    which is what stays within ``max_token_len``. Fewest micro-batches (module doc).
    """
    lengths = _check_lengths(seq_lens)
    budget = _check_budget(max_token_len)
    oversized = _oversized(lengths, budget, allow_oversized)
    oversized_set = set(oversized)
    runs: list[list[int]] = []
    for i in _order_longest_first([i for i in range(len(lengths)) if i not in oversized_set], lengths):
        if runs and (len(runs[-1]) + 1) * lengths[runs[-1][0]] <= budget:
            runs[-1].append(i)
        else:
            runs.append([i])
    fewest = len(runs) + len(oversized)
    if num_micro_batches is not None:
        if num_micro_batches < fewest:
            raise ValueError(
                f"plan_padded_micro_batches: num_micro_batches={num_micro_batches} is too few; {fewest} are needed "
                f"for {len(lengths)} sequences padded to their micro-batch's longest under max_token_len={budget}"
            )
        # Halving a run of length-sorted sequences keeps both halves within the budget.
        while len(runs) + len(oversized) < num_micro_batches and any(len(r) > 1 for r in runs):
            costliest = max((r for r in runs if len(r) > 1), key=lambda r: (len(r) * lengths[r[0]], -r[0]))
            at = runs.index(costliest)
            half = (len(costliest) + 1) // 2
            runs[at : at + 1] = [costliest[:half], costliest[half:]]
        runs += [[] for _ in range(num_micro_batches - len(runs) - len(oversized))]
    bins = [sorted(r) for r in runs] + [[i] for i in oversized]

    def padded(b: list[int]) -> int:
        return len(b) * max((lengths[i] for i in b), default=0)

    ordered = sorted(bins, key=lambda b: (-padded(b), b[0] if b else len(lengths)))
    return MicroBatchPlan(
        micro_batches=tuple(tuple(b) for b in ordered),
        token_sums=tuple(padded(b) for b in ordered),
        oversized=tuple(oversized),
        max_token_len=budget,
    )


def plan_data_parallel(
    seq_lens: Sequence[int],
    max_token_len: int,
    world_size: int,
    *,
    allow_oversized: bool = False,
) -> DataParallelPlan:
    """Split a mini-batch over ``world_size`` ranks (balanced by tokens), then into micro-batches.

    Every rank gets the same number of micro-batches: the fewest the busiest rank needs.
    Indices in the result refer to the mini-batch (``seq_lens``). See the module doc.
    """
    lengths = _check_lengths(seq_lens)
    budget = _check_budget(max_token_len)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
        raise ValueError(f"plan_data_parallel: world_size={world_size!r} must be a positive integer")
    oversized = _oversized(lengths, budget, allow_oversized)

    ranks = [sorted(r) for r in _rebalance(_longest_first(list(range(len(lengths))), lengths, world_size), lengths)]
    ranks.sort(key=lambda r: (-sum(lengths[i] for i in r), r[0] if r else len(lengths)))
    local_plans = [plan_micro_batches([lengths[i] for i in r], budget, allow_oversized=allow_oversized) for r in ranks]
    count = max(p.num_micro_batches for p in local_plans)
    micro_batches, token_sums = [], []
    for rank, plan in zip(ranks, local_plans):
        if plan.num_micro_batches != count:
            local_lengths = [lengths[i] for i in rank]
            plan = plan_micro_batches(local_lengths, budget, num_micro_batches=count, allow_oversized=allow_oversized)
        micro_batches.append(tuple(tuple(rank[j] for j in mb) for mb in plan.micro_batches))
        token_sums.append(plan.token_sums)
    return DataParallelPlan(
        rank_indices=tuple(tuple(r) for r in ranks),
        micro_batches=tuple(micro_batches),
        token_sums=tuple(token_sums),
        oversized=tuple(oversized),
        max_token_len=budget,
    )


def token_mean_weights(micro_batches: Sequence[Sequence[Sequence[int]]], loss_tokens: Sequence[int]) -> list[list[float]]:
    """Per-micro-batch weights for a token-mean loss over the whole mini-batch.

    ``micro_batches[r][m]``: sequence indices of micro-batch m on rank r (a
    ``DataParallelPlan.micro_batches``, or ``[plan.micro_batches]`` for one card);
    ``loss_tokens[i]``: sequence i's loss tokens (its response-mask sum, not its length).
    Returns ``weights[r][m]`` = loss tokens of micro-batch (r, m) / loss tokens of all
    micro-batches, so ``sum weights[r][m] * token_mean(r, m)`` = the mini-batch's token-mean.
    A micro-batch without loss tokens (a padding one) weighs 0: skip its NaN token-mean, or
    compute its loss as ``masked_sum / total`` directly.
    """
    counts = []
    for r, rank in enumerate(micro_batches):
        row = []
        for m, micro in enumerate(rank):
            tokens = 0
            for i in micro:
                if not 0 <= i < len(loss_tokens):
                    raise ValueError(
                        f"token_mean_weights: micro_batches[{r}][{m}] holds index {i}, "
                        f"outside loss_tokens (length {len(loss_tokens)})"
                    )
                if loss_tokens[i] < 0:
                    raise ValueError(f"token_mean_weights: loss_tokens[{i}]={loss_tokens[i]} is negative")
                tokens += loss_tokens[i]
            row.append(tokens)
        counts.append(row)
    total = sum(sum(row) for row in counts)
    if total <= 0:
        raise ValueError("token_mean_weights: the mini-batch has no loss tokens; a token-mean is undefined")
    return [[c / total for c in row] for row in counts]


# ----------------------------------------------------------------------------- checks


def _check_lengths(seq_lens: Sequence[int]) -> list[int]:
    lengths = []
    for i, value in enumerate(seq_lens):
        if isinstance(value, bool) or int(value) != value or value <= 0:
            raise ValueError(f"seq_lens[{i}]={value!r} must be a positive integer (tokens of prompt + response)")
        lengths.append(int(value))
    return lengths


def _check_budget(max_token_len: int) -> int:
    if isinstance(max_token_len, bool) or int(max_token_len) != max_token_len or max_token_len <= 0:
        raise ValueError(f"max_token_len={max_token_len!r} must be a positive integer")
    return int(max_token_len)


def _oversized(lengths: list[int], budget: int, allowed: bool) -> list[int]:
    over = [i for i, n in enumerate(lengths) if n > budget]
    if over and not allowed:
        shown = ", ".join(f"#{i} ({lengths[i]} tokens)" for i in over[:5])
        more = f" and {len(over) - 5} more" if len(over) > 5 else ""
        raise ValueError(
            f"{len(over)} sequence(s) exceed max_token_len={budget}: {shown}{more}. Raise the token budget "
            "(algorithm.ppo_max_token_len_per_gpu / forward_max_token_len_per_gpu) to at least "
            "max_prompt_length + max_response_length, or pass allow_oversized=True to give each its own micro-batch"
        )
    return over


# ----------------------------------------------------------------------------- packing


def _fewest_bins(items: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """Fewest feasible bins found: from the lower bound up, balanced packings; else FFD's."""
    if not items:
        return []
    ffd = _first_fit_decreasing(items, lengths, budget)
    lower_bound = math.ceil(sum(lengths[i] for i in items) / budget)
    for k in range(lower_bound, len(ffd)):
        bins = _balanced_packing(items, lengths, budget, k)
        if bins is not None:
            return bins
    return _rebalance(ffd, lengths)


def _exactly_k_bins(items: list[int], lengths: list[int], budget: int, k: int, feasible: list[list[int]]) -> list[list[int]]:
    """``k`` feasible bins, given a feasible packing into at most ``k`` (padded with empty bins)."""
    if k == 0:
        return []
    bins = _balanced_packing(items, lengths, budget, k)
    if bins is not None:
        return bins
    # Splitting a feasible packing keeps it feasible; rebalancing never raises the largest bin.
    bins = [list(b) for b in feasible]
    while len(bins) < k:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            bins.append([])
            continue
        heaviest = max(splittable, key=lambda b: (sum(lengths[i] for i in b), -min(b)))
        bins.remove(heaviest)
        bins.extend(_longest_first(heaviest, lengths, 2))
    return _rebalance(bins, lengths)


def _balanced_packing(items: list[int], lengths: list[int], budget: int, k: int) -> list[list[int]] | None:
    """``k`` bins within the budget, or None: longest-first, overflow repair, then rebalancing."""
    bins = _repair_overflow(_longest_first(items, lengths, k), lengths, budget)
    return None if bins is None else _rebalance(bins, lengths)


def _order_longest_first(items: list[int], lengths: list[int]) -> list[int]:
    return sorted(items, key=lambda i: (-lengths[i], i))


def _first_fit_decreasing(items: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in _order_longest_first(items, lengths):
        for b, load in enumerate(loads):
            if load + lengths[i] <= budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def _longest_first(items: list[int], lengths: list[int], k: int) -> list[list[int]]:
    """LPT: each item, longest first, to the currently lightest of ``k`` bins (ties: lowest bin)."""
    bins: list[list[int]] = [[] for _ in range(k)]
    heap = [(0, b) for b in range(k)]
    for i in _order_longest_first(items, lengths):
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    return bins


def _repair_overflow(bins: list[list[int]], lengths: list[int], budget: int) -> list[list[int]] | None:
    """Bring every bin within ``budget`` by moves or swaps into bins with room, or return None.

    Each step takes the fullest bin and the change that removes the most of its excess
    (then the smallest change, then the lowest bin and item); the partner bin stays within
    the budget, so the total excess strictly decreases and the loop ends.
    """
    bins = [list(b) for b in bins]
    loads = [sum(lengths[i] for i in b) for b in bins]
    while True:
        over = max(range(len(bins)), key=lambda b: (loads[b], -b))
        excess = loads[over] - budget
        if excess <= 0:
            return bins
        candidates = []  # (-excess removed, size of the change, partner bin, item out, item back or -1)
        for partner, partner_items in enumerate(bins):
            room = budget - loads[partner]
            if partner == over or room <= 0:
                continue
            for out in bins[over]:
                if lengths[out] <= room:
                    candidates.append((-min(lengths[out], excess), lengths[out], partner, out, -1))
                for back in partner_items:
                    delta = lengths[out] - lengths[back]
                    if 0 < delta <= room:
                        candidates.append((-min(delta, excess), delta, partner, out, back))
        if not candidates:
            return None
        _, _, partner, out, back = min(candidates)
        _exchange(bins, loads, lengths, over, partner, out, back)


def _rebalance(bins: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """Lower the heaviest bin by single moves or swaps with the lightest bin that allows one.

    Each accepted change leaves both bins strictly lighter than the old heaviest, so no bin
    ever exceeds the largest load it started from (a feasible packing stays feasible) and
    the sum of squared loads strictly decreases (the loop ends).
    """
    bins = [list(b) for b in bins]
    loads = [sum(lengths[i] for i in b) for b in bins]
    while len(bins) > 1:
        heavy = max(range(len(bins)), key=lambda b: (loads[b], -b))
        for partner in sorted(range(len(bins)), key=lambda b: (loads[b], b)):
            gap = loads[heavy] - loads[partner]
            if gap <= 1:  # partners are visited lightest first: no later one can take anything
                return bins
            # (gap left between the two bins, item leaving heavy, item leaving partner or -1)
            moves = [(abs(gap - 2 * lengths[out]), out, -1) for out in bins[heavy] if 0 < lengths[out] < gap]
            swaps = [
                (abs(gap - 2 * (lengths[out] - lengths[back])), out, back)
                for out in bins[heavy]
                for back in bins[partner]
                if 0 < lengths[out] - lengths[back] < gap
            ]
            if moves or swaps:
                _, out, back = min(moves + swaps)
                _exchange(bins, loads, lengths, heavy, partner, out, back)
                break
        else:
            return bins
    return bins


def _exchange(bins, loads, lengths, source: int, target: int, out: int, back: int) -> None:
    """Move item ``out`` from bin ``source`` to bin ``target`` and, unless ``back`` is -1, ``back`` the other way."""
    bins[source].remove(out)
    bins[target].append(out)
    loads[source] -= lengths[out]
    loads[target] += lengths[out]
    if back >= 0:
        bins[target].remove(back)
        bins[source].append(back)
        loads[target] -= lengths[back]
        loads[source] += lengths[back]


def _finish(bins: list[list[int]], lengths: list[int], oversized: list[int], budget: int) -> MicroBatchPlan:
    ordered = sorted((sorted(b) for b in bins), key=lambda b: (-sum(lengths[i] for i in b), b[0] if b else len(lengths)))
    return MicroBatchPlan(
        micro_batches=tuple(tuple(b) for b in ordered),
        token_sums=tuple(sum(lengths[i] for i in b) for b in ordered),
        oversized=tuple(oversized),
        max_token_len=budget,
    )
