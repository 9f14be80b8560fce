"""Exact digests of weights, as the trainer sent them and as an engine holds or received them.

A digest is a sha256 per named tensor over its dtype, shape and raw bytes (``WeightDigest``),
combined in name order. Any change of any bit, a tensor missing or extra, two tensors swapped
between names: each changes the digest, and ``WeightDigest.differences`` names the tensors.
(A float sum, what this replaced, could not see a swap and was compared at a tolerance that a
``lora_B`` scaled by 1.5 passed.)

LoRA adapters are digested per module (``lora_digest``), named by ``canonical_module`` (from
``layers.<i>.`` on, so that PEFT's ``base_model.model.model.layers.0.self_attn.q_proj`` and
vLLM's ``model.layers.0.self_attn.q_proj`` are one name), in one of two forms:

* as written (``dtype=None``, ``scale_b=False``): what a PEFT folder holds;
* as an engine holds it: ``A.to(dtype)`` and ``B.to(dtype) * scaling`` computed the way vLLM
  0.32 does on load (``LoRAModel.from_lora_tensors`` casts on CPU, ``optimize()`` multiplies
  ``lora_b`` in place), so the trainer can compute, bit for bit, what a faithful engine holds.

Merged weights sent in packed buckets are compared a bucket at a time (``bucket_digest``):
the server's workers answer with one sha256 per bucket received.

Cost (``bench/digest_cost.py``, H200 machine): sha256 at 1.26 GB/s a thread; tensors are
hashed in parallel threads (hashlib releases the GIL). An actor adapter of 299M fp32 values
took 0.41 s as written and 1.14 s as held (bf16): the 27B's (467M) a second or two a side, a
sync. The 8B's merged weights (16.4 GB bf16 on the GPU) took 12 s, the copies to the host
dominating: the nccl transfer, which reports nothing back, is not digested.

Who calls it: the weight-sync callback (what was sent), the engines (what they hold), tests.
"""

from __future__ import annotations

import hashlib
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

import torch

_LAYER = re.compile(r"(?:^|\.)(layers\.\d+\..+)$")


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of ``dtype``, ``shape`` and the raw bytes of ``tensor`` (row-major, on CPU)."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    digest = hashlib.sha256(f"{str(flat.dtype).removeprefix('torch.')}{tuple(tensor.shape)}".encode())
    if flat.numel():
        digest.update(flat.view(torch.uint8).numpy())
    return digest.hexdigest()


def _hash_all(tensors: list[torch.Tensor]) -> list[str]:
    if len(tensors) < 4:
        return [tensor_sha256(t) for t in tensors]
    with ThreadPoolExecutor(max_workers=max(1, min(16, os.cpu_count() or 1))) as pool:
        return list(pool.map(tensor_sha256, tensors))


@dataclass
class WeightDigest:
    """``entries``: name -> ``tensor_sha256``. ``total``: one sha256 over the sorted entries."""

    entries: dict[str, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def total(self) -> str:
        digest = hashlib.sha256()
        for name in sorted(self.entries):
            digest.update(f"{name}={self.entries[name]};".encode())
        return digest.hexdigest()

    def differences(self, other: "WeightDigest", limit: int = 4) -> list[str]:
        """What differs between ``self`` (sent) and ``other`` (held), tensor by tensor, by name."""
        missing = sorted(set(self.entries) - set(other.entries))
        extra = sorted(set(other.entries) - set(self.entries))
        changed = sorted(n for n in set(self.entries) & set(other.entries) if self.entries[n] != other.entries[n])
        out = [f"{n} is missing" for n in missing[:limit]]
        out += [f"{n} was not sent" for n in extra[:limit]]
        out += [f"{n} differs" for n in changed[:limit]]
        more = len(missing) + len(extra) + len(changed) - len(out)
        return out + ([f"and {more} more"] if more > 0 else [])

    def to_dict(self) -> dict:
        return {"entries": dict(self.entries)}

    @classmethod
    def from_dict(cls, data: Mapping) -> "WeightDigest":
        return cls(entries=dict(data["entries"]))


def digest_named(named: Iterable[tuple[str, torch.Tensor]]) -> WeightDigest:
    """The digest of ``(name, tensor)`` pairs (a name given twice is an error)."""
    names, tensors = [], []
    for name, tensor in named:
        names.append(name)
        tensors.append(tensor)
    if len(set(names)) != len(names):
        raise ValueError(f"digest_named: names given twice: {sorted({n for n in names if names.count(n) > 1})[:3]}")
    return WeightDigest(dict(zip(names, _hash_all(tensors))))


def bucket_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """One sha256 for a bucket of named tensors (the ``total`` of their digest)."""
    return digest_named(named).total


def canonical_module(name: str) -> str:
    """The name both sides agree on for an adapted module: from ``layers.<i>.`` on, else the
    name without PEFT's ``base_model.model.`` prefix."""
    name = name.removeprefix("base_model.model.")
    match = _LAYER.search(name)
    return match.group(1) if match else name


def lora_modules(state: Mapping[str, torch.Tensor], scaling: float) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """``{module: (A, B, scaling)}`` from PEFT file keys (``...q_proj.lora_A.weight``); a factor
    without its partner is a ``ValueError`` naming it."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        if ".lora_A." in key or ".lora_B." in key:
            module, factor = key.split(".lora_", 1)
            modules.setdefault(module, {})[factor[0]] = tensor
    out = {}
    for module, factors in sorted(modules.items()):
        for factor in ("A", "B"):
            if factor not in factors:
                raise ValueError(f"{module}.lora_{factor}.weight is missing (its partner is there)")
        out[module] = (factors["A"], factors["B"], float(scaling))
    return out


def held_form(a: torch.Tensor, b: torch.Tensor, scaling: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, B)`` as vLLM 0.32 holds them: cast to the LoRA dtype on CPU, ``B *= scaling`` in place."""
    a_held = a.detach().to(device="cpu", dtype=dtype)
    b_held = b.detach().to(device="cpu", dtype=dtype)
    if scaling != 1:
        b_held = b_held.clone() if b_held.data_ptr() == b.data_ptr() else b_held
        b_held *= scaling
    return a_held, b_held


def lora_digest(modules: Mapping[str, tuple[torch.Tensor, torch.Tensor, float]], *,
                dtype: Optional[torch.dtype] = None, scale_b: bool = False) -> WeightDigest:
    """Entries ``<canonical module>.lora_A`` / ``.lora_B``: as written (``dtype`` None), or as an
    engine holds them (``dtype`` set; ``scale_b``: ``B`` multiplied by its scaling, ``held_form``)."""
    named = []
    for module, (a, b, scaling) in modules.items():
        if dtype is not None:
            a, b = held_form(a, b, scaling if scale_b else 1.0, dtype)
        name = canonical_module(module)
        named += [(f"{name}.lora_A", a), (f"{name}.lora_B", b)]
    return digest_named(named)


def dtype_named(name: Optional[str]) -> Optional[torch.dtype]:
    """``torch.float32`` for ``"float32"``; None for None."""
    return None if name is None else getattr(torch, str(name).removeprefix("torch."))
