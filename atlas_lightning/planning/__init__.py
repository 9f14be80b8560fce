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
is ``fla`` when flash-linear-attention is installed on the planning machine (a GPU plan),
else ``torch`` (transformers' reference code, far hungrier), and the plan says so.
"""

from __future__ import annotations

from typing import Any, Optional

from .checks import layout_refusals
from .estimate import GIB, Phase, Plan, estimate
from .shapes import ModelShape, ShapeError, read_model_shape, shape_from_config

DEFAULT_CARD_GIB = 80.0

__all__ = ["GIB", "ModelShape", "Phase", "Plan", "ShapeError", "card_gib_of", "estimate", "linear_kernel_of",
           "make_plan", "read_model_shape", "shape_from_config"]


def card_gib_of(cfg: Any, card_gib: Optional[float] = None) -> float:
    """``card_gib`` if given (``--card-gib``), else ``cfg.plan.card_gib``; ``ValueError`` unless positive."""
    value = float(cfg.plan.card_gib if card_gib is None else card_gib)
    if not value > 0:
        raise ValueError(f"card memory {value} GiB must be positive (plan.card_gib / --card-gib)")
    return value


def linear_kernel_of(cfg: Any, kernel: Optional[str] = None) -> str:
    """``fla`` or ``torch``: ``kernel`` if given, else the config's ``model.linear_attention_kernel``
    (module doc). The planner only looks for the package; it never imports torch."""
    from atlas_lightning.models.linear_kernels import KERNELS, KEY, resolve

    requested = kernel or cfg.model.linear_attention_kernel
    if requested not in KERNELS:
        raise ValueError(f"{KEY}={requested!r} is not one of {', '.join(KERNELS)}")
    if requested != "auto":
        return requested  # what the run will ask for, whatever this machine has installed
    on_gpu = str(cfg.trainer.accelerator) != "cpu"
    return resolve("auto", "cuda" if on_gpu else "cpu", import_modules=False)


def make_plan(cfg: Any, *, card_gib: Optional[float] = None, linear_kernel: Optional[str] = None,
              shape: Optional[ModelShape] = None) -> Plan:
    """The plan of ``cfg``: the shape of ``cfg.model.path`` (or ``shape``), the estimate, and every
    refusal (layout first, then memory). Raises ``ShapeError`` when the model folder is unreadable."""
    shape = shape or read_model_shape(cfg.model.path)
    plan = estimate(shape, cfg, card_gib=card_gib_of(cfg, card_gib), linear_kernel=linear_kernel_of(cfg, linear_kernel))
    plan.refusals[:0] = layout_refusals(cfg, shape)
    if shape.recurrent and plan.model.get("linear_attention_kernel") == "torch" and plan.device == "gpu":
        plan.notes.append("linear attention on transformers' torch reference code (model.linear_attention_kernel="
                          f"{cfg.model.linear_attention_kernel}; flash-linear-attention not "
                          "installed here): estimated with its much larger activations")
    return plan
