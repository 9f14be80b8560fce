"""``sdpa_varlen``: exact attention over packed (or right-padded) rows with no mask at all.

Why: with a packed ``(1, T)`` row, transformers' ``sdpa`` path builds a dense ``(T x T)``
boolean mask (2.4 GB at T = 49,152) and hands it to a masked kernel that computes every one
of the T^2 scores, most of them across sequence boundaries and thrown away; ``flex_attention``
skips those blocks but needs ``torch.compile`` (tens of seconds per shape on first use) and
a BlockMask per micro-batch. Here each packed sequence gets its own causal
``scaled_dot_product_attention`` call with ``is_causal=True`` and no mask, which PyTorch
dispatches to its built-in FlashAttention kernel on GPUs (bf16/fp16, head_dim <= 256):
only the causal triangle of each sequence is computed, nothing is compiled, no mask exists.

Contract (who calls it: transformers' attention modules, once the name is registered by
importing this module and the model is built with ``attn_implementation="sdpa_varlen"``):

* packed layout: batch 1 and the caller passes ``atlas_seq_lens`` (a tuple of Python ints
  summing to the row length) through the decoder's ``**kwargs``; ``ActorCritic`` does. The
  kwargs reach the attention call again when gradient checkpointing replays a layer.
* right-padded layout (``(n, L)`` rows, real tokens first): no ``atlas_seq_lens``; one
  causal call over the whole batch, ignoring the padding mask. That is exact for every real
  token, because causality only lets a real token see earlier positions, which are all real
  when padding only ever follows. Outputs at padded positions are garbage nobody reads.
  Left padding would be wrong; ``PackedBatch.padded_layout`` only right-pads.

* length buckets (packed layout): an attention module given a bucket (``set_length_bucket``;
  ``ActorCritic``'s ``attention_length_bucket``, 1,024 on CUDA) pads each sequence's q/k/v at
  the end to a multiple of it and cuts the output back (``_causal``): exact by causality. On
  Hopper PyTorch picks cuDNN's kernels, which build an execution graph per new length
  (80-110 ms forward + backward on an H200, ~32 new lengths a 32-trajectory batch: 8.7 s of a
  33 s update, ``bench/NOTES.md`` run 15); bucketed, a few graphs serve every length.

* every SDPA backend enabled for these calls (``_every_backend``), PyTorch's own choice among
  them, whatever the process set: vLLM's CUDA platform module turns cuDNN's attention off for the
  whole process when it is imported (``torch.backends.cuda.enable_cudnn_sdp(False)``, a crash
  workaround for some diffusers models), so ``fit``, which imports vLLM for its engine, trained
  on FlashAttention-2 where the update benchmark (no vLLM) ran cuDNN's Hopper kernels: about 10%
  of an 8B micro-step's kernel time there, and the 8B update in ``fit`` 8-11% slower than the
  benchmark on the same batch; on an H200 the benchmark's own batch took 18-19% longer under
  vLLM's flag without this scope, and the same time with it (runs 10 and 11 in
  atlas_lightning/bench/README.md, "On one H200: the whole RL step, run by run").
  The flags are restored after each call, so vLLM's own calls keep its choice.
* the backend each attention module's first call ran is kept on the module (``chosen_backends``;
  ``ActorCritic.attention_backends``): the step benchmark and the update benchmark report it, so
  that a run whose attention took other kernels than the benchmark's shows it.

The mask function registered with it returns ``None`` (no mask is built), so a mask that
transformers would have made is never materialised.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

NAME = "sdpa_varlen"
SEQ_LENS_KWARG = "atlas_seq_lens"


#: Every scaled-dot-product-attention backend this PyTorch has (module doc: ``_every_backend``).
EVERY_BACKEND = [backend for name, backend in SDPBackend.__members__.items() if name != "ERROR"]


def _no_mask(*args, **kwargs) -> None:
    return None


def _every_backend():
    """The trainer's attention calls with every SDPA backend enabled, PyTorch choosing among them
    as where nothing was switched off; the process's flags restored after (module doc)."""
    return sdpa_kernel(EVERY_BACKEND)


def sdpa_varlen_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature: ``query (B, Hq, L, D)``, ``key``/``value``
    ``(B, Hkv, L, D)``; returns ``(B, L, Hq, D)`` and no weights (module doc for the layouts)."""
    if dropout:
        raise ValueError(f"{NAME}: attention dropout {dropout} is not supported (training runs without it)")
    with _every_backend():
        return _attend(module, query, key, value, scaling, kwargs.get(SEQ_LENS_KWARG))


def _attend(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, scaling: Optional[float],
            seq_lens: Optional[Sequence[int]]) -> tuple[Tensor, None]:
    """``sdpa_varlen_attention_forward``'s work, one call per packed sequence (module doc)."""
    bucket = int(getattr(module, BUCKET_ATTR, 0) or 0)
    gqa = query.shape[1] != key.shape[1]
    if seq_lens is None:
        out = _sdpa(module, query, key, value, scaling, gqa)
        return out.transpose(1, 2).contiguous(), None
    if query.shape[0] != 1 or sum(seq_lens) != query.shape[2]:
        raise ValueError(
            f"{NAME}: {SEQ_LENS_KWARG} sums to {sum(seq_lens)} tokens but the packed row has shape "
            f"{tuple(query.shape)} (expected batch 1 and the same length)"
        )
    outputs, start = [], 0
    for length in seq_lens:
        end = start + int(length)
        outputs.append(
            _causal(module, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], scaling, gqa,
                    bucket)
            .transpose(1, 2)  # (B, l, Hq, D): the flash kernels' own memory layout, so no copy
        )
        start = end
    # one copy into the (B, L, Hq, D) result, not a cat along L of (B, Hq, l, D) and then a transpose copy
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
    return out.contiguous(), None


#: The attribute of an attention module holding its length bucket (``set_length_bucket``).
BUCKET_ATTR = "_atlas_length_bucket"


def _causal(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, scaling, gqa: bool,
            bucket: int) -> Tensor:
    """Causal SDPA of one sequence ``(B, H, l, D)``; with ``bucket`` > 0 the three are padded at the
    end to a multiple of it and the output cut back to ``l`` rows. Exact: causality keeps every
    real query away from the padded keys after it. Why: cuDNN's attention (PyTorch's choice on
    Hopper) builds an execution graph for each new length, ~0.1 s forward + backward on an H200
    (``bench/NOTES.md`` run 15); bucketed lengths reuse a few graphs instead of one per sequence."""
    length = query.shape[2]
    padded = -(-length // bucket) * bucket if bucket > 0 else length
    if padded == length:
        return _sdpa(module, query, key, value, scaling, gqa)
    pad = (0, 0, 0, padded - length)
    return _sdpa(module, F.pad(query, pad), F.pad(key, pad), F.pad(value, pad), scaling, gqa)[:, :, :length]


#: The attribute of an attention module holding the SDPA backend its first call ran (``chosen_backends``).
BACKEND_ATTR = "_atlas_sdpa_backend"


def _sdpa(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, scaling, gqa: bool) -> Tensor:
    """Causal SDPA, the module's first call recording which backend PyTorch's dispatch takes for
    these very tensors and flags (``torch._fused_sdp_choice``, the check SDPA itself makes)."""
    if getattr(module, BACKEND_ATTR, None) is None:
        setattr(module, BACKEND_ATTR, _backend_name(query, key, value, scaling, gqa))
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)


def _backend_name(query: Tensor, key: Tensor, value: Tensor, scaling, gqa: bool) -> str:
    """The name of the SDPA backend these tensors dispatch to under the current flags; a record,
    never a reason to stop: ``unknown`` where PyTorch's private check is not there to ask."""
    try:
        choice = torch._fused_sdp_choice(query, key, value, None, 0.0, True, scale=scaling, enable_gqa=gqa)
        return SDPBackend(choice).name
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return "unknown"


def chosen_backends(modules) -> list[str]:
    """The SDPA backends the attention ``modules`` ran at their first calls (sorted, each once;
    empty before any call): what a report shows beside its figures, so that two runs whose
    attention took different kernels show it."""
    return sorted({getattr(m, BACKEND_ATTR) for m in modules if getattr(m, BACKEND_ATTR, None) is not None})


def set_length_bucket(modules, bucket: int) -> int:
    """Give each attention module a length bucket (0: none; ``_causal``); returns how many."""
    if bucket < 0:
        raise ValueError(f"model.attention_length_bucket={bucket} must be 0 (off) or positive")
    count = 0
    for module in modules:
        setattr(module, BUCKET_ATTR, int(bucket))
        count += 1
    return count


def register() -> str:
    """Register ``sdpa_varlen`` (attention and its no-op mask) with transformers; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, sdpa_varlen_attention_forward)
    AttentionMaskInterface.register(NAME, _no_mask)
    return NAME


register()
