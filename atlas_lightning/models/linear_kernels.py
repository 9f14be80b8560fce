"""Which Gated DeltaNet kernels a hybrid model runs: the config key ``model.linear_attention_kernel``.

* ``fla``: flash-linear-attention's Triton kernels (``chunk_gated_delta_rule``, its causal conv1d
  and gated RMSNorm), varlen over a packed row (``cu_seqlens``); CUDA only.
* ``torch``: transformers' reference code for the chunked delta rule and the conv, run on each
  packed sequence apart (``linear_attention.py``): exact, slow, works everywhere.
* ``auto``: ``fla`` where flash-linear-attention imports and the model sits on a CUDA device,
  else ``torch``.

The model (``ActorCritic``) and the planner resolve the key with the same function; the model
imports the package to check it (a Triton too old for it fails there, not at the first step),
the planner only looks for it (it never imports torch). Both report what they chose.

Pure Python; torch and fla are imported only when ``importable`` asks for it.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

from .kernel_choice import choose, import_problem

KERNELS = ("auto", "fla", "torch")
KEY = "model.linear_attention_kernel"
#: What the fla path imports (``linear_attention.py``); all must load for ``fla`` to be usable.
FLA_MODULES = ("fla.ops.gated_delta_rule", "fla.modules.causal_conv1d", "fla.modules.norm.fused_norm_gate")


@lru_cache(maxsize=2)
def fla_problem(import_modules: bool = True) -> Optional[str]:
    """``None`` when flash-linear-attention is usable here, else the reason. ``import_modules``:
    import the kernels' modules (catches a Triton it refuses); False only looks for the package."""
    return import_problem((("fla", "flash-linear-attention (package fla)"),), FLA_MODULES, "flash-linear-attention",
                          import_modules)


def resolve(requested: str, device_type: Optional[str], *, import_modules: bool = True) -> str:
    """``fla`` or ``torch`` for ``requested`` (one of ``KERNELS``) on a device of type
    ``device_type`` (``cuda``, ``cpu``; None: not known, taken as a GPU). Raises ``ValueError``
    naming the key when ``fla`` is asked for and cannot run here (``kernel_choice.choose``)."""
    return choose(KEY, requested, KERNELS, device_type, lambda: fla_problem(import_modules))
