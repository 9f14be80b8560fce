"""Leaner saved activations for the decoder layers that are NOT recomputed in the backward.

A decoder layer kept out of gradient checkpointing (``checkpoint_layers=k`` < all) saves every
activation its backward needs: 6.6 GiB a layer for the 8B shape at 47K tokens (``bench/NOTES.md``, H200
run 1), which caps how many layers can skip the recomputation. Two places hold most of it:

* transformers' RMSNorm computes in fp32 and autograd saves that fp32 copy of its input
  (2 bytes a value more than the bf16 input). ``RMSNormFunction`` runs the same forward ops
  (same bits) under ``no_grad`` and saves the input in its own dtype plus one fp32 ``rstd`` a
  token; its backward is the RMSNorm gradient written out (equal to autograd's up to fp32
  rounding). Two such norms a layer, plus the per-head ``q_norm``/``k_norm`` of Qwen3.
* The SwiGLU MLP ``down(act(gate(x)) * up(x))`` saves ``gate(x)``, ``act(gate(x))``, ``up(x)``
  and the product (the down projection's input): four tensors of the MLP width. Here the tail
  ``down(act(g) * u)`` is ``recompute.SwiGLUDownFunction``: it saves only ``g`` and ``u`` and
  recomputes the product element-wise in the backward (no GEMM replayed); where that function
  does not apply (another activation, a LoRA layer it cannot serve) the tail runs under a
  non-reentrant checkpoint of its own, which also replays the down projection.

Per layer of the 8B shape that is ~2 x 4,096 + 5,120 + 2 x 12,288 fewer saved values a token,
about half of what the layer kept. Forward results are bit-identical to transformers'.

Contract: ``install_lean_activations(decoder_layers, recompute_mlp_tail)`` patches, as instance
attributes (classes untouched), the norms of every given layer whose class computes
``weight * normalize(x)`` (Llama, Qwen2, Qwen3) or ``normalize(x) * (1 + weight)`` in fp32
(Qwen3.5), and, where ``recompute_mlp_tail[i]`` is true, the MLP of layer ``i`` (a module with
``gate_proj``, ``up_proj``, ``down_proj``, ``act_fn``). Give it False for layers that gradient
checkpointing already replays whole (a nested checkpoint would replay the tail twice). The MLP
tail checkpoint keeps the LoRA adapter selection in force at forward time (``adapter_switch``).
Who calls it: ``ActorCritic`` (``lean_activations=True``, the default). With
``model.elementwise_kernels=liger`` the same norms run liger-kernel's one-pass kernel instead
(``install_fused_kernels`` below sets ``_fused_norm``; same saved tensors).
"""

from __future__ import annotations

from types import MethodType
from typing import Sequence

import torch
from torch import Tensor, nn

from . import fused_kernels
from .adapter_switch import checkpoint_keeping_adapter, tuner_layers
from .recompute import SILU_MODULES, swiglu_down

#: RMSNorm classes computing ``weight * (x * rstd).to(dtype)``, weight in the model dtype.
SCALE_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
#: RMSNorm classes computing ``((x * rstd) * (1 + weight.float())).to(dtype)``.
OFFSET_NORMS = ("Qwen3_5RMSNorm", "Qwen3_5TextRMSNorm")
#: SwiGLU MLP classes whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``.
SWIGLU_MLPS = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "Qwen3_5MLP", "Qwen3_5TextMLP")


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm over the last dim saving ``x`` (own dtype) and ``rstd`` (fp32, ``(..., 1)``).
    ``offset=False``: ``weight * (x_f * rstd).to(x.dtype)``; ``offset=True``:
    ``((x_f * rstd) * (1 + weight_f)).to(x.dtype)``, where ``x_f = x.float()``."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, offset: bool) -> Tensor:
        x_f = x.float()
        rstd = torch.rsqrt(x_f.pow(2).mean(-1, keepdim=True) + eps)
        if offset:
            y = ((x_f * rstd) * (1.0 + weight.float())).to(x.dtype)
        else:
            y = weight * (x_f * rstd).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = offset
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x, weight, rstd = ctx.saved_tensors
        x_f = x.float()
        normed = x_f * rstd
        if ctx.offset:
            grad_normed = grad_y.float() * (1.0 + weight.float())
        else:
            grad_normed = (grad_y * weight).float()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            # d/dx of x * rsqrt(mean(x^2) + eps): rstd * (g - normed * mean(g * normed))
            grad_x = (rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dims = tuple(range(grad_y.dim() - 1))
            if ctx.offset:
                grad_w = (grad_y.float() * normed).sum(dims).to(weight.dtype)
            else:
                grad_w = (grad_y * normed.to(x.dtype)).float().sum(dims).to(weight.dtype)
        return grad_x, grad_w, None, None


def _norm_forward(self, x: Tensor) -> Tensor:
    eps, offset = self._lean_norm  # bound once by install_lean_activations (or install_fused_kernels)
    if getattr(self, "_fused_norm", False):  # model.elementwise_kernels=liger (install_fused_kernels)
        return fused_kernels.rms_norm(x, self.weight, eps, offset)
    return RMSNormFunction.apply(x, self.weight, eps, offset)


def _mlp_tail(mlp: nn.Module, gate: Tensor, up: Tensor) -> Tensor:
    return mlp.down_proj(mlp.act_fn(gate) * up)


def _mlp_forward(self, x: Tensor) -> Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    if not torch.is_grad_enabled():
        return _mlp_tail(self, gate, up)
    fused = swiglu_down(self, gate, up)
    if fused is not None:
        return fused
    # built per call (a few modules to walk) so that a deep copy of the model replays its own adapters
    replay = checkpoint_keeping_adapter(tuner_layers(self.down_proj))
    return replay(lambda g, u: _mlp_tail(self, g, u), gate, up)


def _patch_norm(module: nn.Module, fused: bool = False) -> bool:
    """Give ``module`` ``_norm_forward`` if its class is an RMSNorm this module knows (binding its
    eps and kind once; ``fused``: also mark it for liger's kernel, a mark later calls keep);
    whether it was one."""
    name = type(module).__name__
    if name not in SCALE_NORMS + OFFSET_NORMS or not isinstance(getattr(module, "weight", None), Tensor):
        return False
    eps = module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps
    module._lean_norm = (float(eps), name in OFFSET_NORMS)
    if fused:
        module._fused_norm = True
    module.forward = MethodType(_norm_forward, module)
    return True


def install_lean_activations(decoder_layers: Sequence[nn.Module], recompute_mlp_tail: Sequence[bool]) -> dict[str, int]:
    """Patch the norms of every layer and the MLP tails where asked (module doc). Returns the
    counts ``{"norms": n, "mlp_tails": m}`` of modules patched."""
    if len(recompute_mlp_tail) != len(decoder_layers):
        raise ValueError(f"recompute_mlp_tail has {len(recompute_mlp_tail)} entries for {len(decoder_layers)} layers")
    counts = {"norms": 0, "mlp_tails": 0}
    for layer in decoder_layers:
        for module in layer.modules():
            counts["norms"] += _patch_norm(module)
    counts["mlp_tails"] = install_lean_tails(decoder_layers, [i for i, tail in enumerate(recompute_mlp_tail) if tail])
    return counts


def install_lean_tails(decoder_layers: Sequence[nn.Module], indices: Sequence[int]) -> int:
    """Give the SwiGLU MLP of each layer in ``indices`` the lean tail (module doc); returns how
    many got it. Also for ``ActorCritic.enable_recompute_tiers``: a layer replayed whole in some
    micro-batches and kept in others keeps the tail in both (``SwiGLUDownFunction`` is no
    checkpoint: the whole layer's replay runs it once more, nothing twice)."""
    count = 0
    for index in indices:
        mlp = getattr(decoder_layers[index], "mlp", None)
        if mlp is not None and type(mlp).__name__ in SWIGLU_MLPS:
            mlp.forward = MethodType(_mlp_forward, mlp)
            count += 1
    return count


def install_fused_kernels(decoder_layers: Sequence[nn.Module]) -> dict[str, int]:
    """``model.elementwise_kernels=liger``: patch, as instance attributes (classes untouched),
    every RMSNorm of ``decoder_layers`` whose class this module knows (``_norm_forward`` with the
    fused flag: liger's one-pass kernel, same saved tensors), mark every SwiGLU MLP
    (``_atlas_fused_swiglu``: ``recompute`` reads it; a SiLU MLP also gets
    ``fused_kernels.mlp_forward``, which ``install_lean_activations`` and policy ``mlp`` replace where
    they apply) and replace the forward of each ``Qwen3Attention`` by
    ``fused_kernels.attention_forward``. Call it before ``install_mixer_checkpoints``, which binds
    the forward it replays. Returns the counts patched."""
    counts = {"norms": 0, "swiglu": 0, "rotary": 0}
    for layer in decoder_layers:
        for module in layer.modules():
            name = type(module).__name__
            if _patch_norm(module, fused=True):
                counts["norms"] += 1
            elif name in SWIGLU_MLPS:
                module._atlas_fused_swiglu = True
                if type(getattr(module, "act_fn", None)).__name__ in SILU_MODULES and "forward" not in vars(module):
                    # layers replayed whole (policy layer): transformers' MLP with the product fused;
                    # lean_activations / policy mlp install their own forward over this one
                    module.forward = MethodType(fused_kernels.mlp_forward, module)
                counts["swiglu"] += 1
            elif name in fused_kernels.ROTARY_ATTENTIONS and "forward" not in vars(module):
                module.forward = MethodType(fused_kernels.attention_forward, module)
                counts["rotary"] += 1
    return counts
