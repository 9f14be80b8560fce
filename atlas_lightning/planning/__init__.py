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
Hybrid models' linear-attention kernel: ``ATLAS_LINEAR_ATTENTION_KERNEL`` (``fla`` or
``torch``), else ``fla`` when flash-linear-attention and causal-conv1d are importable on this
machine, else ``torch`` (transformers' fallback, far hungrier).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Optional

from .checks import layout_refusals
from .estimate import GIB, Phase, Plan, estimate
from .shapes import ModelShape, ShapeError, read_model_shape, shape_from_config

DEFAULT_CARD_GIB = 80.0

__all__ = ["GIB", "ModelShape", "Phase", "Plan", "ShapeError", "card_gib_of", "estimate", "linear_kernel_from_env",
           "make_plan", "read_model_shape", "shape_from_config"]


def card_gib_of(cfg: Any, card_gib: Optional[float] = None) -> float:
    """``card_gib`` if given (``--card-gib``), else ``cfg.plan.card_gib``; ``ValueError`` unless positive."""
    value = float(cfg.plan.card_gib if card_gib is None else card_gib)
    if not value > 0:
        raise ValueError(f"card memory {value} GiB must be positive (plan.card_gib / --card-gib)")
    return value


def linear_kernel_from_env(kernel: Optional[str] = None) -> str:
    """``fla`` or ``torch`` (module doc)."""
    kernel = kernel or os.environ.get("ATLAS_LINEAR_ATTENTION_KERNEL") or "auto"
    if kernel == "auto":
        found = all(importlib.util.find_spec(name) is not None for name in ("fla", "causal_conv1d"))
        return "fla" if found else "torch"
    if kernel not in ("fla", "torch"):
        raise ValueError(f"ATLAS_LINEAR_ATTENTION_KERNEL={kernel!r} is not one of fla, torch, auto")
    return kernel


def make_plan(cfg: Any, *, card_gib: Optional[float] = None, linear_kernel: Optional[str] = None,
              shape: Optional[ModelShape] = None) -> Plan:
    """The plan of ``cfg``: the shape of ``cfg.model.path`` (or ``shape``), the estimate, and every
    refusal (layout first, then memory). Raises ``ShapeError`` when the model folder is unreadable."""
    shape = shape or read_model_shape(cfg.model.path)
    plan = estimate(shape, cfg, card_gib=card_gib_of(cfg, card_gib), linear_kernel=linear_kernel_from_env(linear_kernel))
    plan.refusals[:0] = layout_refusals(cfg, shape)
    if shape.recurrent and plan.model.get("linear_attention_kernel") == "torch" and plan.device == "gpu":
        plan.notes.append("linear attention runs transformers' torch fallback here (flash-linear-attention or "
                          "causal-conv1d not importable): estimated with its much larger activations")
    return plan
