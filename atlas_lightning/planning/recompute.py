"""``model.checkpoint_layers=auto``: one recompute policy a decoder layer, the least replayed
work whose update fits the card.

Recomputation is exact: a replayed part runs its forward again in the backward, and the numbers
do not change. So the choice trades memory for time only. Each decoder layer takes one of
``models/recompute.py``'s policies: ``layer`` (checkpointed whole: keeps its input, replays all of
it), ``mixer`` (replays the attention or Gated DeltaNet, keeps the MLP's tensors) or ``none`` (keeps
everything); ``mlp`` is left to ``model.layer_recompute`` (below). The choice is what
``model.layer_recompute`` would say, and ``fit`` builds it so.

The rule, from the planner's own prediction (``estimate.update_tensors``: the ``update_actor`` and
``update_critic`` phases at ``algorithm.ppo_max_token_len_per_gpu``, per-policy bytes from
``activations.layer_parts``)::

    need(plan) = max(tensors(update_actor, plan), tensors(update_critic, plan)) x ALLOCATOR_SLACK
    room       = free - RUNTIME_GIB - MARGIN x card

Start from every layer ``layer``. Each layer's policies (``AUTO_POLICIES``: ``layer``, ``mixer``,
``none``), ordered by the bytes they keep, give steps up the upper convex hull of (bytes kept,
FLOPs a token no longer replayed): ``replayed_flops`` counts a policy's linear layers (2 x in x
out a token; attention's own FLOPs and LoRA's are left out: they grow with sequence length and
are small beside the projections). All layers' steps are taken in order of FLOPs saved per byte,
best first (ties: the last layers first, so what stays checkpointed whole is the first layers, as
``checkpoint_layers=k`` has it), each kept where ``need`` of the plan with it still fits ``room``
(a refused step ends that layer's climb). Then, the last layer first, each layer takes the policy
off the hull that replays less than its own and still fits, if any. For a dense layer the hull is
``layer`` -> ``mixer`` -> ``none`` (the MLP keeps more FLOPs per byte than attention), which is the
plan the update benchmark found best under a cap. ``mlp`` is ``model.layer_recompute``'s alone: it
replaces the MLP's forward at the build, and ``auto``'s plans change between micro-batches. When
even every layer ``layer`` does not fit, the choice is that plan with ``fits=False``: ``plan``
refuses the update phases as for any config, ``fit`` warns and runs as it would have without
``auto``.

**Per micro-batch** (``choose_tiers``): the budget is the worst case, and most micro-batches
carry fewer tokens (the dynamic packer fills them to what a mini-batch holds: half the budget in
the 8B step benchmark). The same rule at 15/16, 14/16, ... 1/16 of the budget gives the plans of
smaller micro-batches (sixteenths: on an H100 the 8B's 8.5K-token micro-batches replay 10% of a
forward under the 12,288-token plan and nothing under the 9,216-token one); the model runs each micro-batch under the plan of the smallest
tier that holds it (``ActorCritic.use_recompute_for``; every rank the same one, for the largest
micro-batch of the step's ranks). The peak stays the budget's: each tier's plan fits at the
tier's own size.

``free`` is the memory the trainer can have when its model is about to be built. ``fit``
measures it on the card (``run/recompute.py``): the driver's free memory once PyTorch's cached
blocks are returned, the colocated engine already asleep, the least over ranks. ``plan`` takes
the card less what it puts beside the trainer (``estimate.training_overhead`` without the runtime:
the engine asleep, a server sharing the card). Then, taken from ``free``:

* ``RUNTIME_GIB`` (1 GiB, the plan's own term): cuBLAS and cuDNN workspaces and NCCL's buffers
  arrive after the measurement;
* ``MARGIN`` (5% of the card): the prediction's error. Against the update benchmark's H200
  peaks (``bench/results/run13-*.json``, ``run15d``) the per-policy terms land from +2% to +6% on
  the small stacks (dense ``none`` / ``mixer`` / ``mlp``, the 27B's 3 + 1 layers kept) and +2 to
  +7% on the 36-layer mixed plans; ``fit`` on an H100 with every layer checkpointed, 34.47 GiB
  predicted for 33.85 measured. The margin also covers what the allocator loses to micro-batches
  of different sizes beyond the slack's 5%.

Who calls it: ``planning.make_plan`` (the plan of a config with ``auto``), ``run/recompute.py``
(``fit`` and memory-check, on the card). Pure Python (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from .activations import POLICIES, layer_parts
from .estimate import ALLOCATOR_SLACK, AUTO, GIB, RUNTIME, RUNTIME_GIB, Inputs, training_overhead, update_tensors
from .shapes import ModelShape

#: Part of the card kept free for the prediction's error (module doc).
MARGIN = 0.05
#: The policies ``auto`` gives (``mlp`` replaces an MLP's forward at the build, so it cannot
#: change between micro-batches; ``model.layer_recompute`` still takes it).
AUTO_POLICIES = ("layer", "mixer", "none")
#: The micro-batch sizes, as shares of ``algorithm.ppo_max_token_len_per_gpu``, that get a plan
#: of their own (``choose_tiers``).
TIER_SHARES = tuple(k / 16 for k in range(16, 0, -1))
KEY = "model.checkpoint_layers"


def is_auto(model_cfg: Any) -> bool:
    """True when ``model_cfg.checkpoint_layers`` asks for the choice (``auto``)."""
    return model_cfg.checkpoint_layers == AUTO


def nothing_to_choose(model_cfg: Any) -> Optional[str]:
    """Why ``auto`` chooses nothing for ``model_cfg`` whatever the card (a line to log), or None
    where it chooses: ``model.layer_recompute`` decides, or nothing is recomputed at all."""
    if model_cfg.layer_recompute is not None:
        return f"{KEY}=auto: model.layer_recompute is set and decides (auto unused)"
    if not model_cfg.gradient_checkpointing:
        return f"{KEY}=auto: gradient checkpointing is off (model.gradient_checkpointing), nothing is recomputed"
    return None


@dataclass(frozen=True)
class RecomputeChoice:
    """The recompute policy ``auto`` gives each decoder layer on one card, and why (bytes unless said)."""

    #: One policy a decoder layer (``activations.POLICIES``): ``model.layer_recompute``.
    plan: tuple[str, ...]
    #: Whether ``need`` fits ``room`` (False: nothing fits; every layer is checkpointed whole).
    fits: bool
    #: ``algorithm.ppo_max_token_len_per_gpu``: the micro-batch the update is sized at.
    tokens: int
    need: float
    room: float
    free: float
    card: float
    #: ``need`` with every layer checkpointed whole (the plan's floor).
    need_all_layers: float
    #: FLOPs a token the backward replays under ``plan``, and with every layer checkpointed whole.
    replayed: float
    replayed_all_layers: float

    @property
    def layers(self) -> int:
        return len(self.plan)

    @property
    def checkpointed(self) -> int:
        """Layers checkpointed whole."""
        return self.plan.count("layer")

    @property
    def counts(self) -> dict[str, int]:
        return {p: self.plan.count(p) for p in POLICIES if p in self.plan}

    @property
    def margin(self) -> float:
        return self.free - self.room

    def describe(self) -> str:
        """One line: the policies, the predicted update peak and the room it was held to."""
        verdict = ("fits" if self.fits else "does NOT fit even with every layer checkpointed: lower "
                   "algorithm.ppo_max_token_len_per_gpu or use more cards")
        counts = ", ".join(f"{n} {p}" for p, n in self.counts.items())
        share = self.replayed / self.replayed_all_layers if self.replayed_all_layers else 0.0
        return (f"{KEY}=auto: {self.checkpointed} of {self.layers} decoder layers checkpointed whole "
                f"(policies: {counts}; replays {share:.0%} of what checkpointing every layer does); "
                f"predicted update peak {self.need / GIB:.2f} GiB (trainer tensors x{ALLOCATOR_SLACK} at "
                f"{self.tokens:,} tokens) {verdict} in {self.room / GIB:.2f} GiB = {self.free / GIB:.2f} GiB free "
                f"of a {self.card / GIB:.1f} GiB card less {self.margin / GIB:.2f} GiB (runtime {RUNTIME_GIB:g} + "
                f"{MARGIN:.0%} of the card)")

    def to_dict(self) -> dict:
        return {"plan": list(self.plan), "counts": self.counts, "checkpointed": self.checkpointed,
                "layers": self.layers, "fits": self.fits, "tokens": self.tokens, "need_gib": self.need / GIB,
                "need_all_layers_gib": self.need_all_layers / GIB, "room_gib": self.room / GIB,
                "free_gib": self.free / GIB, "card_gib": self.card / GIB, "replayed_flops": self.replayed,
                "replayed_flops_all_layers": self.replayed_all_layers}


def room(free: float, card: float) -> float:
    """Bytes the trainer's tensors (with slack) may take of ``free`` on a ``card`` (module doc)."""
    return free - RUNTIME_GIB * GIB - MARGIN * card


def replayed_flops(shape: ModelShape, kind: str, policy: str) -> float:
    """FLOPs a token the backward replays in one ``kind`` layer under ``policy`` (module doc:
    the linear layers only)."""
    linears = {lin.name: 2.0 * lin.in_features * lin.out_features for lin in shape.linears(kind)}
    mlp = {name: linears.pop(name) for name in ("gate_proj", "up_proj", "down_proj")}
    mixer = sum(linears.values())
    return {"layer": mixer + sum(mlp.values()), "mixer": mixer, "mlp": mlp["gate_proj"] + mlp["up_proj"],
            "none": 0.0}[policy]


@dataclass(frozen=True)
class _Step:
    layer: int
    before: str
    after: str
    per_byte: float


def _steps(shape: ModelShape, inputs: Inputs, linear_kernel: str) -> list[_Step]:
    """Every layer's steps up its hull (module doc), best FLOPs saved per byte first."""
    steps = []
    hulls = {kind: _hull(shape, inputs, linear_kernel, kind) for kind in set(shape.layer_types)}
    for index, kind in enumerate(shape.layer_types):
        steps.extend(_Step(index, before, after, per_byte) for before, after, per_byte in hulls[kind])
    return sorted(steps, key=lambda step: (-step.per_byte, -step.layer))


def _hull(shape: ModelShape, inputs: Inputs, linear_kernel: str, kind: str) -> list[tuple[str, str, float]]:
    """``(before, after, FLOPs saved per byte)`` along the upper convex hull of one ``kind`` layer's
    policies, from ``layer`` (bytes: ``layer_parts`` at the larger of the two adapters' ranks)."""
    role = max(inputs.lora, key=lambda r: inputs.lora[r].rank)
    adapted = len(shape.adapted_linears(kind, inputs.lora[role].target_modules))
    parts = layer_parts(shape, kind, c=inputs.compute_bytes, rank=inputs.lora[role].rank, adapted=adapted,
                        linear_kernel=linear_kernel, lean=inputs.lean)
    full = replayed_flops(shape, kind, "layer")
    layer_input = shape.hidden_size * inputs.compute_bytes  # what a layer checkpointed whole keeps
    points = sorted(((parts.kept(p, inputs.lean) + (layer_input if p == "layer" else 0.0),
                      full - replayed_flops(shape, kind, p), p) for p in AUTO_POLICIES), key=lambda x: (x[0], -x[1]))
    hull, (at_bytes, at_saved, at) = [], points[0]
    remaining = [pt for pt in points[1:] if pt[1] > at_saved]
    while remaining:
        best = max(remaining, key=lambda pt: ((pt[1] - at_saved) / max(pt[0] - at_bytes, 1e-9), pt[1]))
        hull.append((at, best[2], (best[1] - at_saved) / max(best[0] - at_bytes, 1e-9)))
        at_bytes, at_saved, at = best
        remaining = [pt for pt in remaining if pt[0] > at_bytes and pt[1] > at_saved]
    return hull


def _fill(shape: ModelShape, plan: list[str], fits) -> list[str]:
    """Where the room left is less than a layer's next hull step, a policy off the hull may
    still fit: each layer, the last first, takes the policy saving the most replay over its own
    that ``fits``."""
    for index in reversed(range(len(plan))):
        kind = shape.layer_types[index]
        own = replayed_flops(shape, kind, plan[index])
        for policy in sorted(AUTO_POLICIES, key=lambda p: replayed_flops(shape, kind, p)):
            if replayed_flops(shape, kind, policy) >= own:
                break
            trial = plan[:index] + [policy] + plan[index + 1:]
            if fits(trial):
                plan = trial
                break
    return plan


def choose(shape: ModelShape, inputs: Inputs, *, free: float, card: float, linear_kernel: str) -> RecomputeChoice:
    """The plan of least replayed work whose predicted update fits ``room(free, card)`` (module
    doc); every layer checkpointed whole when none fits (``fits=False``). ``inputs``: the config's
    (``Inputs.from_config``); ``linear_kernel``: the Gated DeltaNet path the trainer runs."""
    limit = room(free, card)

    def need(plan: list[str]) -> float:
        return update_tensors(shape, inputs, linear_kernel, plan) * ALLOCATOR_SLACK

    plan = ["layer"] * shape.num_layers
    floor = need(plan)
    fits = floor <= limit
    if fits:
        for step in _steps(shape, inputs, linear_kernel):
            if plan[step.layer] != step.before:
                continue  # an earlier step of this layer was refused: its climb ended there
            trial = plan[:step.layer] + [step.after] + plan[step.layer + 1:]
            if need(trial) <= limit:
                plan = trial
        plan = _fill(shape, plan, lambda trial: need(trial) <= limit)
    replayed = sum(replayed_flops(shape, kind, p) for kind, p in zip(shape.layer_types, plan))
    everything = sum(replayed_flops(shape, kind, "layer") for kind in shape.layer_types)
    return RecomputeChoice(plan=tuple(plan), fits=fits, tokens=inputs.update_tokens, need=need(plan), room=limit,
                           free=free, card=card, need_all_layers=floor, replayed=replayed,
                           replayed_all_layers=everything)


def choose_tiers(shape: ModelShape, inputs: Inputs, *, free: float, card: float,
                 linear_kernel: str) -> list[RecomputeChoice]:
    """``choose`` at each of ``TIER_SHARES`` (sixteenths) of the micro-batch budget, the largest first: a
    micro-batch of fewer tokens keeps more (``ActorCritic.use_recompute_for`` takes the plan of
    the smallest tier that holds it). The first is the budget's own choice, alone where it does
    not fit."""
    budget = inputs.update_tokens
    tiers = []
    for share in TIER_SHARES:
        tokens = max(int(budget * share), 1)
        if tiers and tokens == tiers[-1].tokens:
            break
        tiers.append(choose(shape, replace(inputs, update_tokens=tokens), free=free, card=card,
                            linear_kernel=linear_kernel))
        if not tiers[0].fits:
            break  # nothing fits the budget: every layer is checkpointed, whatever the micro-batch
    return tiers


def describe_tiers(tiers: list[RecomputeChoice]) -> str:
    """One line: each tier's micro-batch size, its policies and the share of full recomputation
    (a tier whose plan is the next larger one's is left out: the larger one names it)."""
    shown = [c for i, c in enumerate(tiers) if c.replayed_all_layers and (i == 0 or c.plan != tiers[i - 1].plan)]
    parts = [f"<= {c.tokens:,} tokens: " + ", ".join(f"{n} {p}" for p, n in c.counts.items())
             + f" ({c.replayed / c.replayed_all_layers:.0%} replayed)" for c in shown]
    return f"{KEY}=auto per micro-batch: " + "; ".join(parts)


def choose_for_plan(shape: ModelShape, cfg: Any, *, card_gib: float, linear_kernel: str) -> RecomputeChoice:
    """``choose`` for a card of ``card_gib`` GiB as ``plan`` sees it: free is the card less what
    the plan puts beside the trainer (``beside_trainer``)."""
    inputs = Inputs.from_config(cfg)
    card = card_gib * GIB
    return choose(shape, inputs, free=card - _beside(inputs, card), card=card, linear_kernel=linear_kernel)


def beside_trainer(cfg: Any, card: float) -> float:
    """Bytes the plan puts beside the trainer on a training card of ``card`` bytes, the runtime
    excepted (``room`` takes it): the engine asleep, or a server sharing the card. Memory-check
    reserves it for the engine it builds only after the model (``run/recompute.py``)."""
    return _beside(Inputs.from_config(cfg), card)


def _beside(inputs: Inputs, card: float) -> float:
    return sum(v for k, v in training_overhead(inputs, card).items() if k != RUNTIME)
