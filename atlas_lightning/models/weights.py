"""Weights for the engines: the adapter's tensors, or the base with the adapter merged in.

Everything here works from FULL tensors. Under FSDP2 a parameter is a DTensor sharded on
dim 0, unevenly when the dim does not divide by the world size (torch.chunk semantics: with
6 ranks some shards are short or empty). Merging shard by shard, ``B_shard @ A_shard``, is
wrong (both LoRA factors are sharded on dim 0, so the shards do not multiply into a shard of
``B @ A``): that is how report 28's 6-rank layout got NaN entropies. So each parameter is
first gathered whole (``DTensor.full_tensor()``, a collective), then merged exactly as a
one-process model would.

Collective contract: ``adapter_state``, ``merged_weights`` and ``save_adapter`` gather
parameter by parameter in a fixed order; under FSDP2 EVERY rank must call them and drive
the generators to the end in lockstep, even ranks that throw the tensors away. Peak extra
memory is about two full parameters (the gathered base weight and its merged copy).

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

from typing import Iterable, Iterator

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import Tensor, nn

from .actor_critic import ADAPTERS, ActorCritic
from .merge_kernel import merge_lora


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
    wanted = {id(p) for p in model._adapter_parameters(adapter_name)}
    gathered = {}
    with torch.no_grad():
        for name, param in model.peft_model.named_parameters():
            if id(param) in wanted:
                gathered[name] = full_tensor(param.detach()).clone()
    return get_peft_model_state_dict(
        model.peft_model, state_dict=gathered, adapter_name=adapter_name, save_embedding_layers=False
    )


def _merge_into(layer: BaseTunerLayer, adapter: str, weight: Tensor, out: Tensor | None = None) -> Tensor:
    """``weight + scaling * B @ A`` (module doc) with ``merge_kernel.merge_lora``: the factors cast
    to ``weight``'s dtype (``scaling`` folded into B first), fp32 accumulation, one rounding; on
    CUDA one pass over W. ``weight`` is full. With ``out`` (same shape and dtype as ``weight``)
    the sum is written there instead of a new tensor."""
    if adapter not in layer.lora_A:
        if out is None:
            return weight
        return out.copy_(weight)
    if layer.use_dora.get(adapter, False) or layer.lora_bias.get(adapter, False):
        raise NotImplementedError(f"merging DoRA or LoRA-bias adapters is not supported ({type(layer).__name__})")
    lora_a = full_tensor(layer.lora_A[adapter].weight.detach())
    lora_b = full_tensor(layer.lora_B[adapter].weight.detach())
    if layer.fan_in_fan_out:  # weight is (in, out): (B @ A).T = A.T @ B.T, scaling still on B
        return merge_lora(weight.T, lora_b, lora_a, layer.scaling[adapter], None if out is None else out.T).T
    return merge_lora(weight, lora_b, lora_a, layer.scaling[adapter], out)


def _merge_plan(model: ActorCritic) -> list[tuple[str, nn.Module, str, BaseTunerLayer | None]]:
    """``(checkpoint name, owning module, parameter name, tuner layer or None)`` for every base
    parameter, in module order, tied duplicates once. Built on first use and kept on the model:
    walking the peft model's ~5,000 modules cost 10 ms a sync on the 8B shape (H200, issue 9).
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


def _merged_sources(model: ActorCritic, adapter_name: str) -> Iterator[tuple[str, Tensor, BaseTunerLayer | None]]:
    """``(checkpoint name, full base tensor, tuner layer to merge from or None)`` in
    ``merged_weights``' order (collective under FSDP2: gathers one parameter at a time)."""
    _check_adapter(model, adapter_name)
    if model.checkpoint_names is None:
        raise NotImplementedError(
            f"merged weights cannot be named for {model.base_path}: {model.checkpoint_names_problem}"
        )
    for name, owner, param_name, tuner in _merge_plan(model):
        yield name, full_tensor(getattr(owner, param_name).detach()), tuner


def merged_weights(model: ActorCritic, adapter_name: str = "actor") -> Iterator[tuple[str, Tensor]]:
    """Yield ``(checkpoint name, full tensor)`` for every base parameter, with ``adapter_name``
    merged into the LoRA-wrapped linears' weights (in the base dtype). Names are the base
    checkpoint's (``model.layers.0.self_attn.q_proj.weight``; for Qwen3.5/3.6 checkpoints
    ``model.language_model.layers...``), what vLLM's ``load_weights`` expects; tied duplicates
    appear once. Collective under FSDP2: every rank iterates to the end. Unsharded, the tensors
    of unmerged parameters are the model's own storage: treat every yielded tensor as read-only."""
    with torch.no_grad():
        for name, tensor, tuner in _merged_sources(model, adapter_name):
            yield name, (tensor if tuner is None else _merge_into(tuner, adapter_name, tensor))


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
    """``merged_weights`` grouped by ``bucket_weights`` (default 512 MiB, report 28's cap)."""
    return bucket_weights(merged_weights(model, adapter_name), bucket_bytes)



#: Byte alignment of each tensor inside a packed bucket (any dtype's element size divides it).
PACK_ALIGN = 16


def merged_weight_packs(
    model: ActorCritic, adapter_name: str = "actor", bucket_bytes: int = 512 * 2**20
) -> Iterator[tuple[Tensor, list[tuple[str, Tensor]]]]:
    """``merged_weight_buckets`` with each bucket in ONE contiguous buffer: yields ``(buffer,
    [(name, tensor)])`` where ``buffer`` is a 1-D uint8 tensor on the weights' device and every
    tensor is a view into it (at ``PACK_ALIGN``-byte offsets), ready for a one-shot transfer.
    The merge writes straight into the buffer (no merged copy, no second pass to pack), with
    the same bits as ``merged_weights``. Bucketing as ``bucket_weights`` (a tensor over
    ``bucket_bytes`` gets a buffer of its own). A fresh buffer per bucket: views stay valid
    for as long as the caller holds them. Collective under FSDP2, like ``merged_weights``."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be positive")

    def aligned(n: int) -> int:
        return (n + PACK_ALIGN - 1) // PACK_ALIGN * PACK_ALIGN

    pending: list[tuple[str, Tensor, BaseTunerLayer | None]] = []
    size = 0

    def flush():
        total = sum(aligned(t.numel() * t.element_size()) for _, t, _ in pending)
        buffer = torch.empty(total, dtype=torch.uint8, device=pending[0][1].device)
        views, offset = [], 0
        for name, tensor, tuner in pending:
            nbytes = tensor.numel() * tensor.element_size()
            view = buffer[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
            if tuner is None:
                view.copy_(tensor)
            else:
                _merge_into(tuner, adapter_name, tensor, out=view)
            views.append((name, view))
            offset += aligned(nbytes)
        return buffer, views

    with torch.no_grad():
        for name, tensor, tuner in _merged_sources(model, adapter_name):
            nbytes = tensor.numel() * tensor.element_size()
            if pending and size + nbytes > bucket_bytes:
                yield flush()
                pending, size = [], 0
            pending.append((name, tensor, tuner))
            size += nbytes
        if pending:
            yield flush()
