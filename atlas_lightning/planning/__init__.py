"""``plan``: predict each card's memory for a run and refuse what cannot run, before launch.

    atlas-lightning plan experiment=r28-continued-cost-8gpu-t73728-memory        # 80 GiB cards
    atlas-lightning plan experiment=... plan.card_gib=139                          # H200
    python -m atlas_lightning.planning --card-gib 139 --json experiment=...

Pieces: ``shapes`` (the base's shape from its ``config.json``), ``estimate`` (the per-phase,
per-card memory model; its docstring gives every term), ``checks`` (layouts refused outright),
``report`` (the table and ``outputs/<name>/plan.json``). ``make_plan`` joins them; the exit
code of the verb is 0 when the plan passes and 2 when it refuses (the reasons are printed).

Card memory: the ``card_gib`` argument (``--card-gib``), else ``plan.card_gib`` (default 80: the
report's A100 80GB).
Hybrid models' linear-attention kernel: the config key ``model.linear_attention_kernel``, the
one the trainer reads (``models/linear_kernels.py``): ``fla`` or ``torch`` as given; ``auto``
is planned for the target, not the planning machine: ``fla`` on GPUs (the CUDA install brings
flash-linear-attention), ``torch`` on a CPU run; the plan prints which it assumed.

The shape: ``model.path``'s ``config.json``, or, while that folder is not there (the weights
not yet fetched), the named ``model.shape`` (``named_shapes.py``; ``model=qwen3_6_27b`` sets it).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from .checks import layout_refusals
from .estimate import GIB, Phase, Plan, estimate
from .shapes import ModelShape, ShapeError, read_model_shape, shape_from_config

DEFAULT_CARD_GIB = 80.0

__all__ = ["GIB", "ModelShape", "Phase", "Plan", "ShapeError", "card_gib_of", "estimate", "linear_kernel_of",
           "make_plan", "planned_shape", "read_model_shape", "shape_from_config"]


def card_gib_of(cfg: Any, card_gib: Optional[float] = None) -> float:
    """``card_gib`` if given (``--card-gib``), else ``cfg.plan.card_gib``; ``ValueError`` unless
    positive and finite (an infinite card would plan every phase as fitting)."""
    value = float(cfg.plan.card_gib if card_gib is None else card_gib)
    if not 0 < value < math.inf:
        raise ValueError(f"card memory {value} GiB must be positive and finite (plan.card_gib / --card-gib)")
    return value


def linear_kernel_of(cfg: Any, kernel: Optional[str] = None) -> str:
    """``fla`` or ``torch``: ``kernel`` if given, else the config's ``model.linear_attention_kernel``
    (module doc). The planner only looks for the package; it never imports torch."""
    from atlas_lightning.models.linear_kernels import KERNELS, KEY

    requested = kernel or cfg.model.linear_attention_kernel
    if requested not in KERNELS:
        raise ValueError(f"{KEY}={requested!r} is not one of {', '.join(KERNELS)}")
    if requested != "auto":
        return requested  # what the run will ask for, whatever this machine has installed
    # ``auto`` is planned for the target, not for the planning machine: a GPU run takes fla where
    # the CUDA install has it (pyproject's cuda extras and README, "Install"), a CPU run torch
    return "fla" if str(cfg.trainer.accelerator) != "cpu" else "torch"


def planned_shape(cfg: Any) -> ModelShape:
    """The shape to plan: ``cfg.model.path``'s ``config.json`` when the folder is there, else the
    named ``cfg.model.shape`` (``named_shapes.py``: plan before the weights are fetched);
    ``ShapeError`` naming both keys when neither is."""
    from pathlib import Path

    from .named_shapes import named_config

    path, name = cfg.model.path, cfg.model.get("shape")
    if (Path(str(path)) / "config.json").is_file():
        return read_model_shape(path)
    if not name:
        try:
            return read_model_shape(path)  # refused, naming model.path
        except ShapeError as err:
            raise ShapeError(f"{err}; to plan before the weights are fetched, name the architecture: "
                             f"model.shape=qwen3_6_27b (or dense8b, ...)") from None
    try:
        return shape_from_config(named_config(str(name)), f"model.shape={name}")
    except ValueError as err:
        raise ShapeError(str(err)) from None


def make_plan(cfg: Any, *, card_gib: Optional[float] = None, linear_kernel: Optional[str] = None,
              shape: Optional[ModelShape] = None, layer_recompute: Optional[Sequence[str]] = None) -> Plan:
    """The plan of ``cfg``: the shape of ``cfg.model.path`` (or ``shape``; ``planned_shape``), the
    estimate, and every refusal (layout first, then memory). The kernels it assumed are in its
    notes. ``model.checkpoint_layers=auto`` is planned at the policies it would choose on this card
    (``recompute.py``; ``Plan.recompute``, and a note), unless ``layer_recompute`` gives them
    (memory-check: the ones its model chose on the card). Raises ``ShapeError`` when no shape can
    be read."""
    shape = shape or planned_shape(cfg)
    kernel = linear_kernel_of(cfg, linear_kernel)
    card = card_gib_of(cfg, card_gib)
    choice, note = _auto_recompute(cfg, shape, card, kernel) if layer_recompute is None else (None, None)
    policies = choice.plan if choice is not None else layer_recompute
    plan = estimate(shape, cfg, card_gib=card, linear_kernel=kernel, layer_recompute=policies)
    plan.recompute = choice.to_dict() if choice is not None else None
    if note:
        plan.notes.append(note)
    plan.refusals[:0] = layout_refusals(cfg, shape)
    if not shape.source.endswith("config.json"):
        plan.notes.append(f"shape from {shape.source} ({cfg.model.path} is not there yet)")
    if shape.recurrent:
        why = ("model.linear_attention_kernel=auto on CUDA: flash-linear-attention, which the CUDA install brings"
               if cfg.model.linear_attention_kernel == "auto" and kernel == "fla" else
               f"model.linear_attention_kernel={cfg.model.linear_attention_kernel}")
        plan.notes.append(f"assumed linear-attention kernel: {kernel} ({why})")
        if kernel == "torch" and plan.device == "gpu":
            plan.notes.append("linear attention on transformers' torch reference code: estimated with its much "
                              "larger activations")
    return plan


def _auto_recompute(cfg: Any, shape: ModelShape, card_gib: float, kernel: str):
    """``(choice, note)`` for ``model.checkpoint_layers=auto`` on this card (``recompute.py``);
    ``(None, note)`` where it chooses nothing (CPU, no checkpointing, ``layer_recompute`` set),
    ``(None, None)`` for any other value."""
    from .recompute import choose_for_plan, is_auto, nothing_to_choose

    if not is_auto(cfg.model):
        return None, None
    unchosen = nothing_to_choose(cfg.model)
    if unchosen:
        return None, unchosen
    if str(cfg.trainer.accelerator) == "cpu":
        return None, "model.checkpoint_layers=auto on CPU: every layer checkpointed (no card to size)"
    # the budget's plan (the update's peak); fit also plans smaller micro-batches (recompute.choose_tiers)
    choice = choose_for_plan(shape, cfg, card_gib=card_gib, linear_kernel=kernel)
    return choice, f"{choice.describe()} (the plan's engine asleep and runtime stand for what fit measures)"
