"""Per-layer recomputation (and the micro-batch token budget) chosen under a memory cap from
the option sweep's measured peaks.

The sweep runs a shortened stack of ``L_s`` layers at ``T_s`` tokens with every layer under one
policy (``models/recompute.py``: ``layer``, ``mixer``, ``mlp``, ``none``) and measures each
peak. From those:

* ``delta[p]`` = (peak with every layer ``p`` - peak with every layer ``layer``) / ``L_s``: what a
  layer under ``p`` holds beyond a checkpointed one, GiB at ``T_s`` tokens (scales with tokens);
* ``static`` = weights and LoRA state (not token-driven, computed from parameter counts), and
  ``act_s`` = the all-``layer`` peak minus the sweep's static: the token-driven rest (layer
  inputs, head and recompute transients) at ``T_s``.

A stack of ``L`` layers at ``T`` tokens with ``n[p]`` layers under each policy is predicted at

    static(L) + (T / T_s) * (act_s + (L - L_s) * T_s * 2 * hidden / 2^30 + sum_p n[p] * delta[p]) * 1.1

(x1.1: run 1's OOM taught that per-layer costs measured on a short stack run a little low at
full depth). Its recomputation is ``sum_p n[p] * flops[p]`` a token (``recompute_flops``: a
whole layer's forward, the mixer's, the MLP's gate and up projections, nothing). ``choose``
returns the plan of least recomputation whose prediction fits the cap, over the budgets given
(largest budget first on ties: fewer micro-batches). Policies go to layers in the order
``layer``, ``mixer``, ``mlp``, ``none`` from the first layer on.

Who calls it: ``cli.py`` (the update of each shape, the batch benchmark). Pure Python.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from itertools import product
from typing import Optional, Sequence

GIB = 2.0**30
ORDER = ("layer", "mixer", "mlp", "none")
SAFETY = 1.1


@dataclass(frozen=True)
class Choice:
    tokens: int
    counts: dict
    predicted_peak_gib: float
    recompute_flops_per_token: float

    @property
    def plan(self) -> list[str]:
        return [p for p in ORDER for _ in range(self.counts.get(p, 0))]

    def to_dict(self) -> dict:
        return asdict(self) | {"plan": self.plan}


def recompute_flops(layer_linears: dict[str, list[tuple[int, int]]], attention_per_token: float) -> dict[str, float]:
    """FLOPs a token each policy replays in one layer. ``layer_linears``: ``(in, out)`` of the
    ``mixer``'s and the ``mlp``'s linears (``mlp`` listed gate, up, down); ``attention_per_token``:
    the mixer's own attention FLOPs a token (0 for linear attention: under 1% of its layer)."""
    mixer = 2.0 * sum(i * o for i, o in layer_linears["mixer"]) + attention_per_token
    gate_up = 2.0 * sum(i * o for i, o in layer_linears["mlp"][:2])
    down = 2.0 * sum(i * o for i, o in layer_linears["mlp"][2:])
    return {"layer": mixer + gate_up + down, "mixer": mixer, "mlp": gate_up, "none": 0.0}


def choose(*, layers: int, budgets: Sequence[int], cap_gib: float, static_gib: float, sweep_layers: int,
           sweep_tokens: int, act_gib: float, delta_gib: dict[str, float], flops: dict[str, float],
           hidden: int) -> Optional[Choice]:
    """The least-recomputation plan that fits ``cap_gib`` (module doc), or None if none fits."""
    policies = [p for p in ORDER if p == "layer" or p in delta_gib]
    best: Optional[Choice] = None
    for tokens in sorted(budgets, reverse=True):
        scale = tokens / sweep_tokens
        base = act_gib + (layers - sweep_layers) * sweep_tokens * 2 * hidden / GIB
        for counts in product(range(layers + 1), repeat=len(policies) - 1):
            rest = layers - sum(counts)
            if rest < 0:
                continue
            n = dict(zip(policies[1:], counts)) | {"layer": rest}
            peak = static_gib + scale * SAFETY * (base + sum(n[p] * delta_gib.get(p, 0.0) for p in n))
            if peak > cap_gib:
                continue
            cost = sum(n[p] * flops[p] for p in n)
            if best is None or cost < best.recompute_flops_per_token - 1e-6:
                best = Choice(tokens, {p: n[p] for p in ORDER if n.get(p)}, peak, cost)
    return best
