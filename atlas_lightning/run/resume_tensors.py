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
* every floating tensor of the state, the trainable tensors and each optimizer's per-parameter
  state (``exp_avg``, ``exp_avg_sq``, ``step``), is finite (a NaN restored would stop the first
  update after the run's config and logs are written, and a resume from the same checkpoint
  would stop again).

Lightning's single-file state is memory-mapped (tensor data is read for the finiteness check
alone); a torch.distributed state (FSDP2) is compared from its metadata (names and shapes), and
its values are read through torch.distributed.checkpoint in bounded batches for the finiteness
check (``run/resume_values.py``).

``ResumeStateError`` naming the checkpoint, the part and what differs (for a value that is not
finite: the tensor, and how many of its values).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

ROLES = ("actor", "critic")
#: Adam's per-parameter tensors, of the parameter's shape.
MOMENTS = ("exp_avg", "exp_avg_sq")


def check_state_tensors(where: str, folder: Path, checkpoint: dict, error: type[Exception]) -> None:
    """``checkpoint``: the single-file Lightning state of ``folder`` (a ``global_step_N``), with
    its ``optimizer_states`` in ``ROLES`` order (``run/resume_state.py`` checked there are two):
    its shapes (``check_state_shapes``), then every tensor finite."""
    state = checkpoint.get("state_dict")
    state = state if isinstance(state, dict) else {}
    moments = [(len([p for group in entry.get("param_groups", []) for p in group.get("params", [])]),
                {moment: [tuple(values[moment].shape) for values in (entry.get("state") or {}).values()
                          if moment in values] for moment in MOMENTS})
               for entry in checkpoint["optimizer_states"]]
    check_state_shapes(where, folder, {key: tuple(tensor.shape) for key, tensor in state.items()}, moments, error)
    for key, tensor in state.items():
        refuse_nonfinite(where, f"state_dict.{key}", tensor, error)
    for index, entry in enumerate(checkpoint["optimizer_states"]):
        for param, values in (entry.get("state") or {}).items():
            for kept, tensor in values.items():
                refuse_nonfinite(where, f"optimizer_{index}.state.{param}.{kept}", tensor, error)


def check_state_shapes(where: str, folder: Path, state: dict[str, tuple], optimizers: list[tuple[int, dict]],
                       error: type[Exception]) -> None:
    """The state's trainable tensors (name -> shape) and each optimizer's ``(parameters listed,
    {moment: [shape of each parameter's]})``, in ``ROLES`` order, against the checkpoint's adapter
    folders (module doc); from a single-file state or a distributed one's metadata alike."""
    if not state:
        raise error(f"{where}: its Lightning state has no trainable tensors (state_dict): a resume would train "
                    f"from fresh adapters")
    expected = {role: _adapter_shapes(folder, role, error, where) for role in ROLES}
    restored = {role: Counter(shape for key, shape in state.items() if _role_of(key) == role) for role in ROLES}
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
    for role, (listed, moments) in zip(ROLES, optimizers):
        if listed != sum(expected[role].values()):
            raise error(f"{where}: the {role} optimizer lists {listed} parameters, its adapter trains "
                        f"{sum(expected[role].values())}: not this model's optimizer state")
        for moment, shapes in moments.items():
            if shapes and Counter(shapes) != expected[role]:
                raise error(f"{where}: the {role} optimizer's {moment} tensors have other shapes than the {role} "
                            f"adapter's tensors: not this model's optimizer state")


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


def refuse_nonfinite(where: str, key: str, tensor: Any, error: type[Exception]) -> None:
    """Raise ``error`` when ``tensor``, a floating tensor of the state under ``key`` (a
    torch.distributed checkpoint's key: ``state_dict.<name>`` or ``optimizer_<i>.state.<param>.<kept>``,
    ``<i>`` in ``ROLES`` order), holds NaN or inf: naming the tensor and how many of its values."""
    from atlas_lightning.models.finite_values import nonfinite_counts

    bad = sum(nonfinite_counts(tensor))
    if not bad:
        return
    count = f"{bad} NaN or inf value(s) of {tensor.numel()}"
    section, _, rest = key.partition(".")
    index = section.removeprefix("optimizer_")
    if section == "state_dict":
        part = f"its Lightning state's trainable tensor {rest} holds {count}"
    elif index.isdigit() and int(index) < len(ROLES) and rest.startswith("state."):
        param, _, kept = rest.removeprefix("state.").rpartition(".")
        part = f"the {ROLES[int(index)]} optimizer's {kept} holds {count} (parameter {param})"
    else:
        part = f"its Lightning state's tensor {key} holds {count}"
    raise error(f"{where}: {part}: resume from an earlier checkpoint")


def _shown(shapes: Counter) -> str:
    return ", ".join(f"{list(shape)} x{count}" for shape, count in list(shapes.items())[:3]) or "none"
