"""The rule behind each optional Triton kernel package's config key (``auto`` | the package |
``torch``): ``linear_kernels`` (flash-linear-attention, ``model.linear_attention_kernel``) and
``fused_kernels`` (liger-kernel, ``model.elementwise_kernels``) both choose with it.

Pure Python: a package is imported only when ``import_problem`` is asked to (the planner, which
never imports torch, only looks for it)."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Callable, Optional, Sequence


def import_problem(required: Sequence[tuple[str, str]], modules: Sequence[str], label: str,
                   import_modules: bool) -> Optional[str]:
    """``None`` when every ``(package, what)`` of ``required`` is installed and, with
    ``import_modules``, each of ``modules`` imports (catches a Triton the package refuses); else
    the reason, naming ``what`` or ``label`` and the module."""
    for package, what in required:
        if importlib.util.find_spec(package) is None:
            return f"{what} is not installed"
    if not import_modules:
        return None
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as err:  # e.g. its version checks refuse the installed Triton
            return f"{label} is installed but {name} fails to import: {type(err).__name__}: {err}"
    return None


def choose(key: str, requested: str, choices: Sequence[str], device_type: Optional[str],
           problem: Callable[[], Optional[str]]) -> str:
    """``choices[1]`` (the package) or ``torch`` for ``requested``, one of ``choices`` (``auto``,
    the package, ``torch``), on a device of type ``device_type`` (``cuda``, ``cpu``; None: not
    known, taken as a GPU). ``problem()``: why the package cannot run here, or None; asked only on
    a GPU. Raises ``ValueError`` naming ``key`` for an unknown choice, or when the package is asked
    for and cannot run here."""
    if requested not in choices:
        raise ValueError(f"{key}={requested!r} is not one of {', '.join(choices)}")
    if requested == "torch":
        return "torch"
    package = choices[1]
    reason = None if device_type in (None, "cuda") else f"its Triton kernels need a CUDA device, the model is on {device_type}"
    reason = reason or problem()
    if reason is None:
        return package
    if requested == package:
        raise ValueError(f"{key}={package} cannot run here: {reason} (use auto or torch)")
    return "torch"
