"""Do a checkpoint's trainable tensors and Adam moments fit its adapters? Checked before a resume writes anything.

Lightning restores the module's trainable tensors with ``strict=False`` (the frozen base is not
in a checkpoint): a tensor the state lacks silently keeps this run's fresh initialisation, and
one of another shape, a missing ``state_dict`` or an optimizer whose parameter list differs
from the model's fail only after the run's config and logs are written, with a traceback. The
checkpoint's own adapter folders (verified against ``checkpoint.json``, and against this run's
LoRA settings and base by ``run/resume_adapters.py``) say what the state must hold, so this
compares the state with them, by role and shape:

* ``state_dict`` holds, for each role, exactly as many LoRA factors of the same shapes as the
  role's ``adapter_model.safetensors``, the critic's value head as its
  ``value_head.safetensors``, and nothing else;
* each optimizer (``actor``, ``critic``) lists as many parameters as its role trains, and each
  Adam moment has the shape of one of them (the same multiset of shapes);
* every trainable tensor and moment is finite (a NaN restored would stop the first update, and
  a resume from the same checkpoint would stop again).

For Lightning's single-file state, memory-mapped (tensor data is read for the finiteness check
alone). A torch.distributed state (FSDP2 at several ranks) is checked for completeness by
``run/resume_state.py`` from its metadata; its tensors are checked by the load itself.

``ResumeStateError`` naming the checkpoint, the part and what differs.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

ROLES = ("actor", "critic")


def check_state_tensors(where: str, folder: Path, checkpoint: dict, error: type[Exception]) -> None:
    """``checkpoint``: the single-file Lightning state of ``folder`` (a ``global_step_N``), with
    its ``optimizer_states`` in ``ROLES`` order (``run/resume_state.py`` checked there are two)."""
    state = checkpoint.get("state_dict")
    if not isinstance(state, dict) or not state:
        raise error(f"{where}: its Lightning state has no trainable tensors (state_dict): a resume would train "
                    f"from fresh adapters")
    expected = {role: _adapter_shapes(folder, role, error, where) for role in ROLES}
    restored = {role: Counter(tuple(t.shape) for k, t in state.items() if _role_of(k) == role) for role in ROLES}
    for role in ROLES:
        if restored[role] != expected[role]:
            lacking, extra = expected[role] - restored[role], restored[role] - expected[role]
            raise error(f"{where}: its Lightning state's {role} tensors do not match its {role}/lora_adapter: "
                        f"{sum(lacking.values())} missing (shapes {_shown(lacking)}), {sum(extra.values())} of "
                        f"other shapes ({_shown(extra)}): those would restart from fresh values")
    strays = [key for key in state if _role_of(key) is None]
    if strays:
        raise error(f"{where}: its Lightning state holds {len(strays)} tensor(s) neither adapter has "
                    f"({', '.join(strays[:3])})")
    for role, entry in zip(ROLES, checkpoint["optimizer_states"]):
        _check_moments(where, role, entry, expected[role], error)
    bad = [key for key, tensor in state.items() if not _finite(tensor)]
    if bad:
        raise error(f"{where}: its Lightning state's trainable tensors hold NaN or inf ({', '.join(bad[:3])}): "
                    f"resume from an earlier checkpoint")


def _role_of(key: str) -> str | None:
    """``actor`` / ``critic`` for a LoRA factor of that adapter or the value head (the critic's)."""
    if "value_head." in key:
        return "critic"
    for role in ROLES:
        if f".lora_A.{role}." in key or f".lora_B.{role}." in key:
            return role
    return None


def _adapter_shapes(folder: Path, role: str, error: type[Exception], where: str) -> Counter:
    """The shapes of ``role``'s trainable tensors as its adapter folder holds them (LoRA factors,
    and the critic's value head), from the safetensors headers."""
    from atlas_lightning.planning.shapes import ShapeError, safetensors_header

    adapter = folder / role / "lora_adapter"
    files = ["adapter_model.safetensors"] + (["value_head.safetensors"] if role == "critic" else [])
    shapes: Counter = Counter()
    for name in files:
        if not (adapter / name).is_file():
            raise error(f"{where}: its {role} adapter has no {name}")
        try:
            header = safetensors_header(adapter / name)
        except ShapeError as err:
            raise error(f"{where}: {err}") from None
        shapes.update(tuple(entry["shape"]) for key, entry in header.items()
                      if name == "value_head.safetensors" or ".lora_A." in key or ".lora_B." in key)
    return shapes


def _check_moments(where: str, role: str, entry: Any, trained: Counter, error: type[Exception]) -> None:
    """One optimizer's state against the shapes its role trains."""
    params = [p for group in entry.get("param_groups", []) for p in group.get("params", [])]
    if len(params) != sum(trained.values()):
        raise error(f"{where}: the {role} optimizer lists {len(params)} parameters, its adapter trains "
                    f"{sum(trained.values())}: not this model's optimizer state")
    per_param = entry.get("state") or {}
    for moment in ("exp_avg", "exp_avg_sq"):
        tensors = [values[moment] for values in per_param.values() if moment in values]
        if tensors and Counter(tuple(t.shape) for t in tensors) != trained:
            raise error(f"{where}: the {role} optimizer's {moment} tensors have other shapes than the {role} "
                        f"adapter's tensors: not this model's optimizer state")
        if any(not _finite(t) for t in tensors):
            raise error(f"{where}: the {role} optimizer's {moment} holds NaN or inf: resume from an earlier "
                        f"checkpoint")


def _finite(tensor: Any) -> bool:
    import torch

    return not torch.is_tensor(tensor) or not tensor.is_floating_point() or bool(torch.isfinite(tensor).all())


def _shown(shapes: Counter) -> str:
    return ", ".join(f"{list(shape)} x{count}" for shape, count in list(shapes.items())[:3]) or "none"
