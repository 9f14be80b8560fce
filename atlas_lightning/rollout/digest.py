"""Exact digests of weights, as the trainer sent them and as an engine holds or received them.

A digest is a fingerprint per named tensor over its dtype, shape and raw bytes (``tensor_digest``),
combined in name order by one sha256 (``WeightDigest``). It is computed where the tensor lives
(the GPU for a merged sync: nothing is copied to the host) in exact integer arithmetic, so the
trainer's GPU, an engine's GPU and a CPU give the same string for the same bytes. What it sees:
any change of one value (any bit), any two values swapped inside a tensor (within 2^32 words), a
tensor missing or extra, two tensors swapped between names; ``WeightDigest.differences`` names
the tensors. (A float sum, what an early version used, could not see a swap and was compared at
a tolerance that a ``lora_B`` scaled by 1.5 passed.) It is a checksum against faults, not a
cryptographic hash: changes crafted to cancel in all three sums would pass.

LoRA adapters are digested per module (``lora_digest``), named by ``canonical_module`` (from
``layers.<i>.`` on, so that PEFT's ``base_model.model.model.layers.0.self_attn.q_proj`` and
vLLM's ``model.layers.0.self_attn.q_proj`` are one name), in one of two forms:

* as written (``dtype=None``, ``scale_b=False``): what a PEFT folder holds;
* as an engine holds it: ``A.to(dtype)`` and ``B.to(dtype) * scaling`` computed the way vLLM
  0.32 does on load (``LoRAModel.from_lora_tensors`` casts on CPU, ``optimize()`` multiplies
  ``lora_b`` in place), so the trainer can compute, bit for bit, what a faithful engine holds.

Merged weights sent in packed buckets are compared a bucket at a time (``bucket_digest``):
the server's workers answer with one sha256 (over the bucket's entries) per bucket received.

Cost: the first digest, a sha256 of each tensor's bytes on the host, took 12 s for the 8B's
merged weights (16.4 GB of bf16 on the GPU, 16 threads: ``bench/digest_cost.py``) and, one
tensor at a time on both sides of the in-process merged sync, 55 s of a 179 s RL step on the
H200 (``bench/results/step-h200-run2-b-merged.*``): the copies to the host dominated. The
fingerprint reads each tensor on its own device (one float64 conversion and one matrix product
a pass); on this repository's 2-core CPU machine 0.6 GB/s (sha256: 1.7 GB/s a thread). Small
tensors are digested in batches (``digest_named``): a LoRA sync digests a few hundred factors
several times, and one at a time each paid its launches and a read by the host (the held check
took 0.25 s a load for the 16-layer 27B hybrid's r64 adapter on an H100;
``bench/sync_checks.py`` measures both ways).

Who calls it: the weight sync (``rollout/sync.py``: what was sent), the engines (what they hold), tests.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

import torch

_LAYER = re.compile(r"(?:^|\.)(layers\.\d+\..+)$")


#: Words (16-bit, or bytes where a tensor has an odd byte count) a row: a row's words sit at
#: positions ``i`` with the same ``i >> 16``, column ``c`` at ``i = c (mod 2^16)``.
_ROW = 1 << 16
#: Rows converted at a time (8M words: a float64 working copy of 64 MB).
_CHUNK_ROWS = 128
#: Rows summed at a time in int64: every per-row term is below 2^48, so 2^15 rows stay below 2^63.
_SEGMENT_ROWS = 1 << 15
#: Rows of small tensors digested together (``digest_named``), by device type: on a card a batch
#: costs its launches and one read by the host whatever its size; on the host's cores 16 rows (an
#: 8 MiB float64 working copy) ran fastest (2-core CPU: 0.11 s for 224 r64 factors of 5,120
#: columns, 0.28 s at 128 rows, 0.12 s one tensor at a time).
_BATCH_ROWS = {"cuda": _CHUNK_ROWS, "cpu": 16}


def _position_weights(start: int, count: int, device) -> torch.Tensor:
    """``w(k) = (40503 k mod 2^16) + 1`` for ``k`` in ``[start, start + count)``: a bijection of
    ``k mod 2^16`` onto ``1..2^16`` (40503 is odd), so two positions share a weight only 2^16 apart."""
    return _weights_of(torch.arange(start, start + count, device=device, dtype=torch.int64))


def _weights_of(k: torch.Tensor) -> torch.Tensor:
    """``w(k)`` (``_position_weights``) of each int64 position in ``k``."""
    return ((k & 0xFFFF) * 40503 & 0xFFFF) + 1


@functools.lru_cache(maxsize=None)
def _column_weights(device: torch.device) -> torch.Tensor:
    """``(2^16, 2)`` float64: ones and ``w(c)`` per column, made once per device (a sync digests
    hundreds of tensors; the weights never change)."""
    return torch.stack([torch.ones(_ROW, dtype=torch.float64, device=device),
                        _position_weights(0, _ROW, device).to(torch.float64)], 1)


def _words(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The raw bytes of ``tensor`` (row-major) as 16-bit words (bytes if their count is odd), and
    the mask that reads a word as an unsigned value."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if raw.numel() % 2:
        return raw, 0xFF
    try:
        return raw.view(torch.int16), 0xFFFF
    except RuntimeError:  # a byte view at an odd offset
        return raw.clone().view(torch.int16), 0xFFFF


def _unsigned_float64(words: torch.Tensor, mask: int) -> torch.Tensor:
    """``words`` read as unsigned integers, in float64 (exact: below 2^16)."""
    if words.dtype == torch.int16:
        try:
            return words.view(torch.uint16).to(torch.float64)
        except (RuntimeError, TypeError):  # a build without uint16 casts: the same values
            pass
    return (words.to(torch.int32) & mask).to(torch.float64)


def tensor_digest(tensor: torch.Tensor) -> str:
    """``<dtype><shape>:<s1>.<s2>.<s3>`` (hex) over the raw bytes of ``tensor``, read as unsigned
    words ``x_i``: ``s1 = sum x_i``, ``s2 = sum x_i w(i)``, ``s3 = sum x_i w(i >> 16)``
    (``_position_weights``). A changed value moves ``s1``; a swap of ``x_i`` and ``x_j`` moves
    ``s2`` unless ``i = j mod 2^16``, and then ``s3`` unless ``i = j mod 2^32``.

    Computed on the tensor's device, exactly: each row of 2^16 words goes through one float64
    matrix product (every product and partial sum is an integer below 2^48, which float64 holds
    exactly in any summation order), the rows' sums are combined in int64, and the host reads
    three integers per 2^31 words. Same bytes, same string, on any device."""
    return _words_digest(tensor, *_words(tensor))


def _words_digest(tensor: torch.Tensor, words: torch.Tensor, mask: int) -> str:
    """``tensor_digest(tensor)`` from its ``_words`` already read (a contiguous copy, for a view
    that is not, is made once)."""
    device, n = words.device, words.numel()
    head = _head(tensor)
    if n == 0:
        return head + "0.0.0"
    column_weights = _column_weights(device)
    per_row = []  # (rows, 2) int64: each row's sum x and sum x w(i)
    for start in range(0, n, _CHUNK_ROWS * _ROW):
        block = _unsigned_float64(words[start:start + _CHUNK_ROWS * _ROW], mask)
        if block.numel() % _ROW:  # zeros add nothing to any sum
            block = torch.cat([block, block.new_zeros(_ROW - block.numel() % _ROW)])
        per_row.append((block.view(-1, _ROW) @ column_weights).to(torch.int64))
    rows = torch.cat(per_row)
    terms = torch.stack([rows[:, 0], rows[:, 1], rows[:, 0] * _position_weights(0, rows.shape[0], device)], 1)
    parts = torch.stack([terms[i:i + _SEGMENT_ROWS].sum(0) for i in range(0, rows.shape[0], _SEGMENT_ROWS)])
    sums = [sum(column) for column in zip(*parts.tolist())]
    return head + ".".join(f"{value:x}" for value in sums)


@dataclass
class WeightDigest:
    """``entries``: name -> ``tensor_digest``. ``total``: one sha256 over the sorted entries."""

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
    """The digest of ``(name, tensor)`` pairs (a name given twice is an error): each entry is
    ``tensor_digest``'s, but small tensors are digested together, a batch of at most
    ``_BATCH_ROWS`` rows on one device at a time (``_batch_digests``). A stream of copies is
    never held whole: at most one batch (16 MiB of words on a card) is held at once."""
    digests: dict[str, str] = {}
    batch: list[tuple[str, torch.Tensor, torch.Tensor, int]] = []
    batch_rows, seen = 0, set()
    for name, tensor in named:
        if name in seen:
            raise ValueError(f"digest_named: names given twice: {name!r}")
        seen.add(name)
        words, mask = _words(tensor)
        rows, cap = -(-words.numel() // _ROW), _BATCH_ROWS.get(words.device.type, _CHUNK_ROWS)
        if mask != 0xFFFF or rows == 0 or rows > cap:  # bytes, empty, or large: alone
            digests[name] = _words_digest(tensor, words, mask)
            continue
        if batch and (batch_rows + rows > cap or words.device != batch[0][2].device):
            digests.update(_batch_digests(batch))
            batch, batch_rows = [], 0
        batch.append((name, tensor, words, rows))
        batch_rows += rows
    if batch:
        digests.update(_batch_digests(batch))
    return WeightDigest(digests)


def _batch_digests(batch: list[tuple[str, torch.Tensor, torch.Tensor, int]]) -> dict[str, str]:
    """``tensor_digest`` of each ``(name, tensor, its 16-bit words, their rows)`` of ``batch``
    (all on one device, at most ``_CHUNK_ROWS`` rows in all), computed together: each tensor's
    words start a row of their own in one zero-padded buffer (so a word's weight is its position
    in its own tensor), one matrix product gives every row's two sums, running sums over the rows
    give each tensor's, and the host reads them once. Why: a LoRA sync digests hundreds of small
    factors several times, and one at a time each paid about ten launches and a read by the host."""
    device = batch[0][2].device
    rows = [count for _, _, _, count in batch]
    buffer = torch.zeros(sum(rows) * _ROW, dtype=torch.int16, device=device)
    start = 0
    for _, _, words, count in batch:
        buffer[start:start + words.numel()].copy_(words)
        start += count * _ROW
    per_row = (_unsigned_float64(buffer, 0xFFFF).view(-1, _ROW) @ _column_weights(device)).to(torch.int64)
    # every row's position in its own tensor, and each tensor's last row (host-made, one copy)
    local = torch.cat([torch.arange(count, dtype=torch.int64) for count in rows]).to(device)
    last = torch.tensor(rows, dtype=torch.int64).cumsum(0).sub_(1).to(device)
    terms = torch.stack([per_row[:, 0], per_row[:, 1], per_row[:, 0] * _weights_of(local)], 1)
    # exact in int64: a batch holds far fewer than 2^15 rows of terms below 2^48 each
    running = terms.cumsum(0)[last]
    sums = torch.cat([running[:1], running[1:] - running[:-1]]).tolist()
    return {name: _head(tensor) + ".".join(f"{value:x}" for value in values)
            for (name, tensor, _, _), values in zip(batch, sums)}


def _head(tensor: torch.Tensor) -> str:
    """A digest's ``<dtype><shape>:`` prefix."""
    return f"{str(tensor.dtype).removeprefix('torch.')}{tuple(tensor.shape)}:"


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


def held_form(a: torch.Tensor, b: torch.Tensor, scaling: float, dtype: torch.dtype,
              device: Any = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, B)`` as vLLM 0.32 holds them: cast to the LoRA dtype on CPU, ``B *= scaling`` in
    place. ``device``: where to compute it instead (a card: no round trip through the host). The
    cast and the product are each one IEEE rounding of a float32 result on either, so a card
    gives the same bytes; ``sync.check_held`` falls back to the host's form when it does not."""
    a_held = a.detach().to(device=device, dtype=dtype)
    b_held = b.detach().to(device=device, dtype=dtype)
    if scaling != 1:
        b_held = b_held.clone() if b_held.data_ptr() == b.data_ptr() else b_held
        b_held *= scaling
    return a_held, b_held


def lora_digest(modules: Mapping[str, tuple[torch.Tensor, torch.Tensor, float]], *,
                dtype: Optional[torch.dtype] = None, scale_b: bool = False, device: Any = None) -> WeightDigest:
    """Entries ``<canonical module>.lora_A`` / ``.lora_B``: as written (``dtype`` None), or as an
    engine holds them (``dtype`` set; ``scale_b``: ``B`` multiplied by its scaling, ``held_form``,
    computed where ``device`` says, else on the host as vLLM computes it). ``device``: where each
    tensor is digested (a copy of the same bytes: the digest does not change, its cost moves off
    the host's cores)."""
    def named():
        for module, (a, b, scaling) in modules.items():
            if dtype is not None:
                a, b = held_form(a, b, scaling if scale_b else 1.0, dtype, "cpu" if device is None else device)
            name = canonical_module(module)
            yield f"{name}.lora_A", a if device is None else a.to(device)
            yield f"{name}.lora_B", b if device is None else b.to(device)
    return digest_named(named())


def dtype_named(name: Optional[str]) -> Optional[torch.dtype]:
    """``torch.float32`` for ``"float32"``; None for None."""
    return None if name is None else getattr(torch, str(name).removeprefix("torch."))
