"""``model.checkpoint_layers=auto``: the fewest checkpointed decoder layers whose update fits.

Recomputation is exact: a checkpointed layer replays its forward in the backward, and the
numbers do not change. So the choice trades memory for time only. A layer kept out of
checkpointing saves its forward's replay (for LoRA about a third of the layer's update: the
backward computes no gradient of the frozen weights) and holds its saved activations instead.
From the planner's own prediction (``estimate.update_tensors``: the ``update_actor`` and
``update_critic`` phases at ``algorithm.ppo_max_token_len_per_gpu``), the choice is the smallest
``k`` (the first ``k`` layers checkpointed, as ``checkpoint_layers=k`` does) whose update fits:

    need(k) = max(tensors(update_actor, k), tensors(update_critic, k)) x ALLOCATOR_SLACK
    room    = free - RUNTIME_GIB - MARGIN x card
    k       = min { j in 0..L : need(j) <= room }

``free`` is the memory the trainer can have when its model is about to be built. ``fit``
measures it on the card (``run/recompute.py``): the driver's free memory once PyTorch's cached
blocks are returned, the colocated engine already asleep, the least over ranks. ``plan`` takes
the card less what it puts beside the trainer (``estimate.training_overhead`` without the runtime:
the engine asleep, a server sharing the card). Then, taken from ``free``:

* ``RUNTIME_GIB`` (1 GiB, the plan's own term): cuBLAS and cuDNN workspaces and NCCL's buffers
  arrive after the measurement;
* ``MARGIN`` (5% of the card): the prediction's error. The plan's dense terms came within 0.5-5%
  of measured peaks (H200 memory-check; on an H100 in ``fit``, 34.47 GiB predicted for 33.85
  measured, 25.65 for 24.43), the fla hybrid's fitted factor within 8%, and kept dense layers are
  over-predicted (their count predates lean activations): on the safe side. The margin also
  covers what the allocator loses to micro-batches of different sizes beyond the slack's 5%.

``need`` is not monotone in ``k`` (from 0 to 1 the replay's transient arrives), so every ``k`` is
tried. When none fits, not even every layer checkpointed, the choice is every layer (what
``checkpoint_layers=null`` does) with ``fits=False``: ``plan`` refuses the update phases as for
any config, ``fit`` warns and runs as it would have without ``auto``.

Who calls it: ``planning.make_plan`` (the plan of a config with ``auto``), ``run/recompute.py``
(``fit`` and memory-check, on the card). Pure Python (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .estimate import ALLOCATOR_SLACK, AUTO, GIB, RUNTIME, RUNTIME_GIB, Inputs, training_overhead, update_tensors
from .shapes import ModelShape

#: Part of the card kept free for the prediction's error (module doc).
MARGIN = 0.05
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
    """The decoder layers ``auto`` checkpoints on one card, and why (bytes unless said)."""

    #: Decoder layers of the model, and the first ``checkpointed`` of them checkpointed.
    layers: int
    checkpointed: int
    #: Whether ``need`` fits ``room`` (False: nothing fits; every layer is checkpointed).
    fits: bool
    #: ``algorithm.ppo_max_token_len_per_gpu``: the micro-batch the update is sized at.
    tokens: int
    need: float
    room: float
    free: float
    card: float
    #: ``need(j)`` for every ``j`` in ``0..layers`` (the choice's evidence).
    needs: tuple[float, ...]

    @property
    def margin(self) -> float:
        return self.free - self.room

    def describe(self) -> str:
        """One line: the count, the predicted update peak and the room it was held to."""
        verdict = ("fits" if self.fits else "does NOT fit even with every layer checkpointed: lower "
                   "algorithm.ppo_max_token_len_per_gpu or use more cards")
        return (f"{KEY}=auto: {self.checkpointed} of {self.layers} decoder layers checkpointed "
                f"({self.layers - self.checkpointed} kept); predicted update peak {self.need / GIB:.2f} GiB "
                f"(trainer tensors x{ALLOCATOR_SLACK} at {self.tokens:,} tokens) {verdict} in "
                f"{self.room / GIB:.2f} GiB = {self.free / GIB:.2f} GiB free of a {self.card / GIB:.1f} GiB card "
                f"less {self.margin / GIB:.2f} GiB (runtime {RUNTIME_GIB:g} + {MARGIN:.0%} of the card)")

    def to_dict(self) -> dict:
        return {"layers": self.layers, "checkpointed": self.checkpointed, "fits": self.fits, "tokens": self.tokens,
                "need_gib": self.need / GIB, "room_gib": self.room / GIB, "free_gib": self.free / GIB,
                "card_gib": self.card / GIB, "needs_gib": [v / GIB for v in self.needs]}


def room(free: float, card: float) -> float:
    """Bytes the trainer's tensors (with slack) may take of ``free`` on a ``card`` (module doc)."""
    return free - RUNTIME_GIB * GIB - MARGIN * card


def choose(shape: ModelShape, inputs: Inputs, *, free: float, card: float, linear_kernel: str) -> RecomputeChoice:
    """The smallest count of checkpointed layers whose predicted update fits ``room(free, card)``
    (module doc), every layer when none does (``fits=False``). ``inputs``: the config's
    (``Inputs.from_config``); ``linear_kernel``: the Gated DeltaNet path the trainer runs."""
    layers = shape.num_layers
    needs = tuple(update_tensors(shape, inputs, linear_kernel, k) * ALLOCATOR_SLACK for k in range(layers + 1))
    limit = room(free, card)
    chosen = next((k for k, need in enumerate(needs) if need <= limit), None)
    k = layers if chosen is None else chosen
    return RecomputeChoice(layers=layers, checkpointed=k, fits=chosen is not None, tokens=inputs.update_tokens,
                           need=needs[k], room=limit, free=free, card=card, needs=needs)


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
