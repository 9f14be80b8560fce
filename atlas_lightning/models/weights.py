"""Weights for the engines: the adapter's tensors, or the base with the adapter merged in.

Everything here works from FULL tensors. Under FSDP2 a parameter is a DTensor sharded on
dim 0, unevenly when the dim does not divide by the world size (torch.chunk semantics: with
6 ranks some shards are short or empty). Merging shard by shard, ``B_shard @ A_shard``, is
wrong (both LoRA factors are sharded on dim 0, so the shards do not multiply into a shard of
``B @ A``): that is how the 6-rank layout of ATLAS report 28 (the reproduced report) got NaN entropies. So each parameter is
first gathered whole (``DTensor.full_tensor()``, a collective), then merged exactly as a
one-process model would.

Collective contract: ``adapter_state``, ``merged_weights`` and ``save_adapter`` gather
parameter by parameter in a fixed order; under FSDP2 EVERY rank must call them and drive
the generators to the end in lockstep, even ranks that throw the tensors away. Peak extra
memory: ``merged_weights`` about two full parameters (the gathered base weight and its merged
copy); ``merged_weight_packs`` one bucket plus the gathered weights of at most one bucket
(``GROUP_SLOTS`` of them at most).

Bitwise equality with a one-process merge: the merge is ``W + (scaling * B).to(W.dtype) @
A.to(W.dtype)`` accumulated in fp32 and rounded once (transposed for ``fan_in_fan_out``), by a
Triton kernel on CUDA that reads W once and writes it once, ``torch.addmm`` elsewhere
(``merge_kernel.py``; peft's own ``merge_and_unload``
writes the delta, scales it and adds it in separate passes, ~10 bf16-sized passes with its fp32
delta; it differs from ours only by rounding, within one unit in the last place of W's dtype
wherever the delta is small next to W). The inputs are the same full tensors at every world
size, and the same ops in the same order on the same device give the same bits; the tests
check sharded against unsharded bit for bit, and both against peft's merge within rounding.

Who calls it: weight sync to the engines (rollout room), ``adapters.save_adapter``.
"""

from __future__ import annotations

from typing import Iterable, Iterator, NamedTuple

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import Tensor, nn

from .actor_critic import ADAPTERS, ActorCritic
from .merge_kernel import GROUP_SLOTS, MergeJob, merge_lora_many


def full_tensor(tensor: Tensor) -> Tensor:
    """The whole tensor: ``DTensor.full_tensor()`` (collective) for a sharded one, else itself."""
    if hasattr(tensor, "full_tensor"):
        return tensor.full_tensor()
    return tensor


def _check_adapter(model: ActorCritic, adapter_name: str) -> None:
    if adapter_name not in ADAPTERS:
        raise ValueError(f"adapter_name={adapter_name!r} is not one of {', '.join(ADAPTERS)}")


def adapter_state(model: ActorCritic, adapter_name: str) -> dict[str, Tensor]:
    """The adapter's LoRA tensors, full (gathered), named as in a PEFT ``adapter_model.safetensors``
    (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``). Collective under FSDP2."""
    from peft import get_peft_model_state_dict

    _check_adapter(model, adapter_name)
    wanted = {id(p) for p in model.adapter_parameters(adapter_name)}
    gathered = {}
    with torch.no_grad():
        for name, param in model.peft_model.named_parameters():
            if id(param) in wanted:
                gathered[name] = full_tensor(param.detach()).clone()
    return get_peft_model_state_dict(
        model.peft_model, state_dict=gathered, adapter_name=adapter_name, save_embedding_layers=False
    )


class _LoraSource(NamedTuple):
    """What a merge reads from a LoRA-wrapped layer besides its weight: the factor modules (their
    ``weight`` is read at each sync, since FSDP2 swaps parameters, not modules), the scaling, and
    whether the weight is stored (in, out)."""

    lora_a: nn.Module
    lora_b: nn.Module
    scaling: float
    fan_in_fan_out: bool

    @classmethod
    def of(cls, layer: BaseTunerLayer, adapter: str) -> "_LoraSource":
        if layer.use_dora.get(adapter, False) or layer.lora_bias.get(adapter, False):
            raise NotImplementedError(f"merging DoRA or LoRA-bias adapters is not supported ({type(layer).__name__})")
        return cls(layer.lora_A[adapter], layer.lora_B[adapter], layer.scaling[adapter], bool(layer.fan_in_fan_out))

    def job(self, weight: Tensor, out: Tensor) -> MergeJob:
        """The merge into the full ``weight``, written to ``out``, as a ``merge_kernel.MergeJob``
        (the factors gathered whole: collective under FSDP2). The module doc states the
        arithmetic; ``fan_in_fan_out`` weights merge transposed: ``(B @ A).T = A.T @ B.T`` with
        the scaling still on B."""
        lora_a, lora_b = full_tensor(self.lora_a.weight), full_tensor(self.lora_b.weight)
        if self.fan_in_fan_out:
            return MergeJob(weight.T, lora_b, lora_a, self.scaling, out.T)
        return MergeJob(weight, lora_b, lora_a, self.scaling, out)


def _merged(layer: BaseTunerLayer | None, adapter: str, weight: Tensor) -> Tensor:
    """``weight`` with ``adapter`` merged in (a new tensor), or ``weight`` itself where there is
    nothing to merge. Call under ``torch.no_grad()``."""
    if layer is None or adapter not in layer.lora_A:
        return weight
    out = torch.empty_like(weight, memory_format=torch.contiguous_format)
    merge_lora_many([_LoraSource.of(layer, adapter).job(weight, out)])
    return out


def _merge_plan(model: ActorCritic) -> list[tuple[str, nn.Module, str, BaseTunerLayer | None]]:
    """``(checkpoint name, owning module, parameter name, tuner layer or None)`` for every base
    parameter, in module order, tied duplicates once. Built on first use and kept on the model:
    walking the peft model's ~5,000 modules cost 10 ms a sync on the 8B shape (H200, ``bench/NOTES.md``).
    Modules never change after construction (FSDP2 swaps parameters, not modules), so the plan
    holds modules and names, and each sync reads the parameters afresh."""
    plan = getattr(model, "_merge_plan_cache", None)
    if plan is not None:
        return plan
    names = model.checkpoint_names
    seen: set[int] = set()
    plan = []
    inside_tuner = None  # named_modules() is pre-order: a tuner's submodules follow it contiguously
    for module_name, module in model.hf_model.named_modules():
        if inside_tuner is not None and module_name.startswith(inside_tuner):
            continue  # LoRA factors and the wrapped base layer: handled with their tuner layer
        inside_tuner = None
        if isinstance(module, BaseTunerLayer):
            inside_tuner = module_name + "."
            owner, tuner = module.get_base_layer(), module
        else:
            owner, tuner = module, None
        for param_name, param in owner.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            loaded_name = f"{module_name}.{param_name}" if module_name else param_name
            if loaded_name not in names:
                raise KeyError(f"merged_weights: {loaded_name} is not a parameter of the base {model.base_path}")
            plan.append((names[loaded_name], owner, param_name, tuner if param_name == "weight" else None))
    model._merge_plan_cache = plan
    return plan


def _check_nameable(model: ActorCritic, adapter_name: str) -> None:
    _check_adapter(model, adapter_name)
    if model.checkpoint_names is None:
        raise NotImplementedError(
            f"merged weights cannot be named for {model.base_path}: {model.checkpoint_names_problem}"
        )


def merged_weights(model: ActorCritic, adapter_name: str = "actor") -> Iterator[tuple[str, Tensor]]:
    """Yield ``(checkpoint name, full tensor)`` for every base parameter, with ``adapter_name``
    merged into the LoRA-wrapped linears' weights (in the base dtype). Names are the base
    checkpoint's (``model.layers.0.self_attn.q_proj.weight``; for Qwen3.5/3.6 checkpoints
    ``model.language_model.layers...``), what vLLM's ``load_weights`` expects; tied duplicates
    appear once. Collective under FSDP2: every rank iterates to the end. Unsharded, the tensors
    of unmerged parameters are the model's own storage: treat every yielded tensor as read-only.
    One merge (one launch) at a time; ``merged_weight_packs`` is the fast path for transfers."""
    _check_nameable(model, adapter_name)
    with torch.no_grad():
        for name, owner, param_name, tuner in _merge_plan(model):
            yield name, _merged(tuner, adapter_name, full_tensor(getattr(owner, param_name).detach()))


def bucket_weights(
    weights: Iterable[tuple[str, Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, Tensor]]]:
    """Group ``(name, tensor)`` pairs, in order, into lists of at most ``bucket_bytes`` bytes.
    A tensor larger than ``bucket_bytes`` travels alone in its own bucket (it cannot be split
    without the receiver knowing how to join it). No bucket is empty."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be positive")
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def merged_weight_buckets(
    model: ActorCritic, adapter_name: str = "actor", bucket_bytes: int = 512 * 2**20
) -> Iterator[list[tuple[str, Tensor]]]:
    """``merged_weights`` grouped as ``bucket_weights`` groups them (default 512 MiB, report 28's
    cap): the views of ``merged_weight_packs`` (one buffer per bucket, merged in grouped launches),
    so unmerged parameters arrive as copies. Collective under FSDP2."""
    for _, views in merged_weight_packs(model, adapter_name, bucket_bytes):
        yield views


#: Byte alignment of each tensor inside a packed bucket (any dtype's element size divides it).
PACK_ALIGN = 16

#: Unmerged tensors below this size are copied into a bucket together (``_foreach_copy_``).
SMALL_COPY_BYTES = 1 << 20


class _PackEntry(NamedTuple):
    """One base parameter's place in a packed bucket. ``lora`` is None where the parameter is
    copied as it is (not a LoRA-wrapped weight, or the adapter is not on that layer)."""

    name: str
    owner: nn.Module
    param_name: str
    lora: _LoraSource | None
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # in elements of ``dtype`` from the buffer's start


class _PackBucket(NamedTuple):
    nbytes: int  # the buffer's size (entries at PACK_ALIGN-byte offsets)
    entries: list[_PackEntry]


def _pack_layout(model: ActorCritic, adapter_name: str, bucket_bytes: int) -> list[_PackBucket]:
    """Where every merged tensor goes: buckets as ``bucket_weights`` cuts them (a tensor over
    ``bucket_bytes`` alone), offsets aligned to ``PACK_ALIGN``. Shapes are the full (global)
    ones, which FSDP2's DTensors report unsharded, so nothing is gathered to plan. Built once per
    (adapter, bucket size) and kept on the model, like ``_merge_plan``: a sync then only reads
    parameters and writes views."""
    cache = getattr(model, "_pack_layout_cache", None)
    if cache is None:
        cache = model._pack_layout_cache = {}
    key = (adapter_name, bucket_bytes)
    if key in cache:
        return cache[key]
    buckets: list[_PackBucket] = []
    entries: list[_PackEntry] = []
    size = offset = 0  # size as bucket_weights counts it; offset with alignment
    for name, owner, param_name, tuner in _merge_plan(model):
        param = getattr(owner, param_name)
        nbytes = param.numel() * param.element_size()
        if entries and size + nbytes > bucket_bytes:
            buckets.append(_PackBucket(offset, entries))
            entries, size, offset = [], 0, 0
        lora = None if tuner is None or adapter_name not in tuner.lora_A else _LoraSource.of(tuner, adapter_name)
        shape = tuple(param.shape)
        stride = tuple(torch.empty(shape, device="meta").stride())
        entries.append(_PackEntry(name, owner, param_name, lora, param.dtype, shape, stride,
                                  offset // param.element_size()))
        size += nbytes
        offset += (nbytes + PACK_ALIGN - 1) // PACK_ALIGN * PACK_ALIGN
    if entries:
        buckets.append(_PackBucket(offset, entries))
    cache[key] = buckets
    return buckets


def merged_weight_packs(
    model: ActorCritic, adapter_name: str = "actor", bucket_bytes: int = 512 * 2**20
) -> Iterator[tuple[Tensor, list[tuple[str, Tensor]]]]:
    """``merged_weights`` in buckets, each in ONE contiguous buffer: yields ``(buffer, [(name,
    tensor)])`` where ``buffer`` is a 1-D uint8 tensor on the weights' device and every tensor
    is a view into it (at ``PACK_ALIGN``-byte offsets), ready for a one-shot transfer. The merge
    writes straight into the buffer (no merged copy, no second pass to pack), with the same bits
    as ``merged_weights``, up to ``GROUP_SLOTS`` merges a launch (``merge_lora_many``).
    Bucketing as ``bucket_weights`` (a tensor over ``bucket_bytes`` gets a buffer of its own).
    A fresh buffer per bucket: views stay valid for as long as the caller holds them.
    Collective under FSDP2, like ``merged_weights``; besides the buffer, at most
    ``GROUP_SLOTS`` gathered weights (of one bucket) are held at once. The work is queued on
    the device: read the buffer on the same stream (or synchronise) before handing it elsewhere."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be positive")
    _check_nameable(model, adapter_name)
    layout = _pack_layout(model, adapter_name, bucket_bytes)
    with torch.no_grad():
        for bucket in layout:
            first = bucket.entries[0]
            buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=getattr(first.owner, first.param_name).device)
            typed: dict[torch.dtype, Tensor] = {}
            views: list[tuple[str, Tensor]] = []
            jobs: list[MergeJob] = []
            small_views: list[Tensor] = []
            small_sources: list[Tensor] = []
            for entry in bucket.entries:
                flat = typed.get(entry.dtype)
                if flat is None:
                    flat = typed[entry.dtype] = buffer.view(entry.dtype)
                view = flat.as_strided(entry.shape, entry.stride, entry.offset)
                tensor = full_tensor(getattr(entry.owner, entry.param_name))
                if entry.lora is not None:
                    jobs.append(entry.lora.job(tensor, view))
                    if len(jobs) == GROUP_SLOTS:
                        merge_lora_many(jobs)
                        jobs = []
                elif tensor.numel() * tensor.element_size() < SMALL_COPY_BYTES:
                    small_views.append(view)
                    small_sources.append(tensor)
                else:
                    view.copy_(tensor)
                views.append((entry.name, view))
            merge_lora_many(jobs)
            if small_views:  # norms and biases: one multi-tensor copy instead of ~25 us of host time each
                torch._foreach_copy_(small_views, small_sources)
            yield buffer, views
