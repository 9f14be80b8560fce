"""``model.checkpoint_layers=auto`` resolved on the training card, as ``PPOModule.configure_model``
is about to build the model; ``planning/recompute.py`` gives the rule (one recompute policy a
decoder layer, the least replayed work whose predicted update fits) and this module what the card
has free at that moment.

The measurement: PyTorch's cached blocks are returned first (``torch.cuda.empty_cache``): the
driver counts them as used, but the trainer's allocations would reuse them. Then the driver's
free memory (``torch.cuda.mem_get_info``), which sees what PyTorch's own counters do not: a
colocated vLLM engine's memory pool, which PyTorch counts as allocated even asleep though vLLM
has unmapped it (``ppo/metrics.memory_metrics``), and what other processes hold. In ``fit`` the
colocated engine is built in the data module's ``setup`` and put to sleep before the build
(``configure_model``), a separate layout's server sharing the card started before it: free is
what the trainer can have through its updates. Memory-check builds its engine only after the
model (``MemoryCheckModule.on_train_start``), so ``engine_to_come`` reserves the plan's figure
for it (``beside_trainer``), for the plan to be the one ``fit`` would take. Every rank takes the
least free memory of all ranks, so all take the same plan (FSDP2's collectives in the backward
follow the recomputation, and ranks must issue the same ones).

Off CUDA (CPU runs, tests) ``auto`` keeps every layer checkpointed, as does a config with
``model.layer_recompute`` (which decides) or without gradient checkpointing (nothing to
recompute); each says so once. The choice is logged once, on rank 0, to the run's log and stderr.

Who calls it: ``verbs.fit`` and ``memory_check.run_memory_check`` (the module's ``checkpoint_layers_for``);
the update benchmark (``choose_for``, ``tier_shares``, ``free_on_card``: its plan is taken as ``fit`` takes it).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Optional

import torch
from omegaconf import DictConfig

from atlas_lightning import distributed as dist_utils
from atlas_lightning.planning import planned_shape, shape_from_config
from atlas_lightning.planning.estimate import Inputs
from atlas_lightning.planning.recompute import KEY, RecomputeChoice, beside_trainer, choose_tiers, describe_tiers, nothing_to_choose
from atlas_lightning.planning.shapes import ModelShape

log = logging.getLogger("atlas_lightning")


class CheckpointLayersFor:
    """``PPOModule``'s ``checkpoint_layers_for`` of the run ``cfg``: ``(device, random_base) ->``
    one policy a decoder layer (module doc). ``engine_to_come``: the engine is built after the model (memory-check).
    ``choice``: the last ``RecomputeChoice`` made (None: none made); ``tiers``: the plans of
    smaller micro-batches, ``(tokens, plan)`` (``planning.recompute.choose_tiers``; empty where
    the budget's plan does not fit) with the share of full recomputation each replays, which
    ``PPOModule`` gives the model and its update's packer."""

    def __init__(self, cfg: DictConfig, *, engine_to_come: bool = False, verb: str = "fit") -> None:
        self.cfg, self.engine_to_come, self.verb = cfg, engine_to_come, verb
        self.choice: Optional[RecomputeChoice] = None
        self.tiers: list[tuple[int, tuple[str, ...], float]] = []

    def __call__(self, device: torch.device, random_base: Any = None) -> Optional[tuple[str, ...]]:
        """The recompute policy of each decoder layer on ``device`` (``model.layer_recompute``'s
        values; None: every layer checkpointed whole). Collective on CUDA."""
        unchosen = nothing_to_choose(self.cfg.model)
        if unchosen:
            return self._say(unchosen)
        if device.type != "cuda":
            return self._say(f"{KEY}=auto on {device.type}: every decoder layer checkpointed (no card to size)")
        free, card = free_on_card(device)
        if self.engine_to_come:
            free -= beside_trainer(self.cfg, card)
        free = -dist_utils.all_reduce_max([-free])[0]  # the least over ranks: one count for all (module doc)
        tiers = choose_for(self.cfg, shape_of(self.cfg, random_base), free=free, card=card)
        choice = self.choice = tiers[0]
        self._say(choice.describe(), warn=not choice.fits)
        self.tiers = tier_shares(tiers)
        if self.tiers:
            self._say(describe_tiers(tiers))
        return choice.plan

    def _say(self, line: str, warn: bool = False) -> None:
        if dist_utils.is_rank_zero():
            (log.warning if warn else log.info)(line)
            print(f"atlas-lightning {self.verb}: {line}", file=sys.stderr)
        return None


def choose_for(cfg: DictConfig, shape: ModelShape, *, free: float, card: float) -> list[RecomputeChoice]:
    """``auto``'s plans for the run ``cfg`` on ``shape`` with ``free`` bytes of a ``card``-byte
    card, on the Gated DeltaNet path the trainer runs there: ``planning.recompute.choose_tiers``,
    the budget's plan first. What ``CheckpointLayersFor`` runs once it has measured the card; the
    update benchmark runs it too (``bench/update.py``: ``fit_plan``)."""
    return choose_tiers(shape, Inputs.from_config(cfg), free=free, card=card,
                        linear_kernel=trainer_linear_kernel(cfg, shape))


def tier_shares(tiers: list[RecomputeChoice]) -> list[tuple[int, tuple[str, ...], float]]:
    """``(tokens, plan, share of full recomputation replayed)`` of each of ``choose_for``'s tiers:
    what ``ActorCritic.enable_recompute_tiers`` and the update's packer take; empty where the
    budget's plan does not fit (every layer checkpointed whatever the micro-batch)."""
    if not tiers or not tiers[0].fits:
        return []
    return [(tier.tokens, tier.plan, tier.replayed / max(tier.replayed_all_layers, 1.0)) for tier in tiers]


def free_on_card(device: torch.device) -> tuple[float, float]:
    """``(free, total)`` bytes of ``device`` as the driver counts them, once this process's cached
    blocks are returned (module doc)."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return float(free), float(total)


def shape_of(cfg: DictConfig, random_base: Any = None) -> ModelShape:
    """The shape of the base the module builds: ``random_base``'s (a transformers config whose
    random weights replace the folder's), else ``model.path``'s (``planning.planned_shape``)."""
    if random_base is not None:
        return shape_from_config(random_base.to_dict(), where=f"the random base's {type(random_base).__name__}")
    return planned_shape(cfg)


def trainer_linear_kernel(cfg: DictConfig, shape: ModelShape) -> str:
    """The Gated DeltaNet path the trainer will run on a CUDA card (``fla`` or ``torch``: the
    model's own rule, ``models/linear_kernels.py``); ``fla`` for a model without such layers,
    where it changes nothing."""
    if not shape.recurrent:
        return "fla"
    from atlas_lightning.models.linear_kernels import resolve

    return resolve(cfg.model.linear_attention_kernel, "cuda")
