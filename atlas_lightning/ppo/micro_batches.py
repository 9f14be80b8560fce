"""How many micro-batches an update's mini-batch is cut into when ``model.checkpoint_layers=auto``
gives smaller micro-batches plans of their own (``planning/recompute.py``, "Per micro-batch").

The fewest micro-batches that hold a mini-batch within ``algorithm.ppo_max_token_len_per_gpu``
is what the packer takes otherwise. With per-size plans, cutting finer can cost less: a smaller
micro-batch replays less of its forward in the backward. The count taken is the one of least
predicted work, from the fewest up to four times as many (never more than the sequences)::

    work(cut) = sum over micro-batches of  tokens x (USEFUL_PASSES + replayed share of its tier)
                                           + MICRO_STEP_TOKENS

where a tier's replayed share is the FLOPs its plan replays over those of every layer replayed
whole (``RecomputeChoice.replayed / replayed_all_layers``; a whole replay is about one forward).
The cut changes no number the update computes beyond float rounding: the loss is the mini-batch's
token mean whatever the micro-batches (``algorithms/ppo.agg_loss`` with the mini-batch's token
count).

* ``USEFUL_PASSES`` = 2: the forward and the backward's input gradients, about one forward each
  (LoRA computes no gradient of the frozen base weights);
* ``MICRO_STEP_TOKENS`` = 1,024: a micro-step's fixed cost in tokens of work (packing, the
  log-prob chunks' launches, host synchronisations, FSDP2's gathers where they do not overlap),
  about 0.1 s at an update's ~10K tokens/s on one card; the 8B step on an H100 (bench README, run
  5 against run 4) put it near 0.12 s. It is the start only: after each role's update the module
  takes the run's own, ``fixed / per_work`` of ``MicroTimer.fixed_cost`` over that update's
  micro-steps (timed with ``work`` as their work), where a fit can be made and its fixed cost is
  above zero (``measured_step_tokens``). A fit whose intercept comes out at zero or below says the
  seconds are not linear in the work over that spread (smaller micro-batches run at a lower rate),
  not that a micro-step costs nothing. Taken as zero, it made ``fit`` cut the 8B step's
  mini-batches into 14 micro-batches a pass where the update benchmark, on the same batch at the
  starting cost, cut 12 and ran 6% faster; how much of that the cut accounts for was not
  measured apart (its run 9: atlas_lightning/bench/README.md, "On one H200: the whole RL step, run by run").

Who calls it: ``PPOModule._plan`` (every pass: ``count`` on each rank, then ``cut`` at the count
all ranks take) and the update benchmark's ``OursRunner`` (one card). Pure Python.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from atlas_lightning.algorithms.partition import plan_micro_batches, plan_padded_micro_batches

USEFUL_PASSES = 2.0
MICRO_STEP_TOKENS = 1024
#: The most micro-batches tried, as a multiple of the fewest.
MOST = 4


def layout_tokens(lengths: Sequence[int], layout: str) -> int:
    """Tokens of one micro-batch as the model's layout counts them: packed the sum, padded rows x longest."""
    if not lengths:
        return 0
    return len(lengths) * max(lengths) if layout == "padded" else sum(lengths)


def replayed_share(shares: Sequence[tuple[int, float]], tokens: int) -> float:
    """The replayed share of the smallest tier holding ``tokens`` (``shares``: ``(tokens, share)``
    ascending), or the largest tier's."""
    return next((share for limit, share in shares if tokens <= limit), shares[-1][1])


def work(tokens: int, share: float) -> float:
    """A micro-batch's work in tokens of a forward (module doc), its fixed cost left out."""
    return tokens * (USEFUL_PASSES + share)


def measured_step_tokens(fit: tuple[float, float] | None, current: float) -> float:
    """A micro-step's fixed cost in tokens of work from ``MicroTimer.fixed_cost``'s ``(fixed s,
    s per unit of work)``: ``fixed / per_work`` where the fit says it is above zero, else
    ``current`` (module doc)."""
    if fit is None or fit[0] <= 0 or fit[1] <= 0:
        return current
    return fit[0] / fit[1]


def cheapest_count(lengths: Sequence[int], fewest: int, layout: str, shares: Sequence[tuple[int, float]],
                   cut: Callable[[int], list[list[int]]], step_tokens: float = MICRO_STEP_TOKENS) -> int:
    """The micro-batch count of least predicted work (module doc), from ``fewest`` up; ``cut(n)``:
    the packer's ``n`` micro-batches of sequence indices; ``step_tokens``: a micro-step's fixed cost
    (``MICRO_STEP_TOKENS`` until the run has measured its own)."""
    shares = sorted(shares)
    best, best_work = fewest, None
    for count in range(fewest, min(len(lengths), MOST * fewest) + 1):
        total = 0.0
        for micro in cut(count):
            tokens = layout_tokens([lengths[i] for i in micro], layout)
            total += work(tokens, replayed_share(shares, tokens)) + step_tokens
        if best_work is None or total < best_work:
            best, best_work = count, total
    return best


def count(lengths: Sequence[int], budget: int, layout: str, shares: Sequence[tuple[int, float]] = (),
          step_tokens: float = MICRO_STEP_TOKENS) -> int:
    """How many micro-batches one rank cuts ``lengths`` into within ``budget`` tokens as
    ``layout`` counts them (packed: the sum; padded: rows x longest): the fewest, or with
    ``shares`` (an update under per-size plans) the count of least predicted work
    (``cheapest_count``); 0 for no sequence."""
    if not lengths:
        return 0
    fewest = len(_planner(layout)(lengths, budget, allow_oversized=True).micro_batches)
    if not shares:
        return fewest
    return cheapest_count(lengths, fewest, layout, shares, lambda n: cut(lengths, budget, layout, n),
                          step_tokens=step_tokens)


def cut(lengths: Sequence[int], budget: int, layout: str, micro_batches: int) -> list[list[int]]:
    """``lengths``' indices in ``micro_batches`` micro-batches within ``budget`` (``count``'s layout)."""
    planner = _planner(layout)
    return [list(mb) for mb in planner(list(lengths), budget, num_micro_batches=micro_batches,
                                       allow_oversized=True).micro_batches]


def _planner(layout: str):
    return plan_padded_micro_batches if layout == "padded" else plan_micro_batches


def apply_tiers(model: Any, tiers: Sequence[tuple[int, Sequence[str], float]]) -> list[tuple[int, float]]:
    """Give ``model`` (an ``ActorCritic``) the plans of ``run/recompute.tier_shares``' ``tiers`` and return the
    update's packer its ``(tokens, share replayed)``: what ``fit`` and the update benchmark both do."""
    if tiers:
        model.enable_recompute_tiers([(tokens, plan) for tokens, plan, _ in tiers])
    return [(int(tokens), float(share)) for tokens, _, share in tiers]
