"""Recomputation finer than a decoder layer: the SwiGLU tail without a GEMM replay, and
checkpoints around a layer's token mixer only.

Whole-layer checkpointing keeps 2 bytes x hidden a token and replays the whole layer (for the
8B shape ~435 MFLOP a token of ~920 useful); an uncheckpointed lean layer keeps ~85 KB a token
(H200, issue 9). Two finer tools between them:

* ``SwiGLUDownFunction``: ``down(act(g) * u)`` for a LoRA-wrapped (or plain) down projection
  as one autograd function that saves ``g``, ``u`` and the low-rank ``(act(g) * u) A^T``
  (``M x r``), not the product: the backward recomputes ``act(g) * u`` element-wise (same ops,
  same bits as the forward) for the LoRA ``A`` gradient and never replays the down GEMM
  (``lean_activations``' earlier tail checkpoint did: a quarter of the layer's forward FLOPs).
  Gradients are autograd's own: ``silu_backward`` for the activation, the fused LoRA
  formulas of ``fused_lora.py`` for the projection.
* ``install_mixer_checkpoints``: the token mixer (``self_attn`` or ``linear_attn``) of the
  chosen layers runs under a non-reentrant checkpoint that keeps the adapter selection
  (``adapter_switch``): it saves only its input (the normed hidden state, 2 bytes x hidden)
  and replays q/k/v projections, the attention or delta rule and the output projection in the
  backward (~30% of a dense layer's forward FLOPs), while the MLP keeps its activations.
  Only in training mode with gradients on; eval and no-grad passes run the mixer plainly.

Who calls it: ``lean_activations`` (the SwiGLU tail), ``ActorCritic`` (``checkpoint_mixers``).
"""

from __future__ import annotations

from types import MethodType
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .adapter_switch import checkpoint_keeping_adapter, tuner_layers

#: Activation modules whose function is ``silu`` (what ``SwiGLUDownFunction`` differentiates).
SILU_MODULES = ("SiLU", "SiLUActivation")


class SwiGLUDownFunction(torch.autograd.Function):
    """``y = h W^T + scaling * (h A^T) B^T`` with ``h = silu(gate) * up``; ``lora_a``/``lora_b``
    None for a plain projection. Shapes: ``gate``, ``up (..., I)``, ``weight (H, I)``,
    ``lora_a (r, I)``, ``lora_b (H, r)``; returns ``(..., H)`` in ``gate``'s dtype."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor, weight: Tensor, lora_a: Optional[Tensor], lora_b: Optional[Tensor],
                scaling: float) -> Tensor:
        dtype = gate.dtype
        h = (F.silu(gate) * up).reshape(-1, gate.shape[-1])
        y = F.linear(h, weight.to(dtype))
        ha = None
        if lora_a is not None:
            ha = h @ lora_a.to(dtype).t()
            y.addmm_(ha, lora_b.to(dtype).t(), alpha=scaling)
        ctx.save_for_backward(gate, up, ha)
        # parameters, not activations: held on ctx so saved-tensor hooks (offload, counting) see activations only
        ctx.params = (weight, lora_a, lora_b)
        ctx.scaling = scaling
        return y.view(*gate.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        gate, up, ha = ctx.saved_tensors
        weight, lora_a, lora_b = ctx.params
        dtype = gate.dtype
        g = grad_out.reshape(-1, grad_out.shape[-1]).to(dtype)
        grad_h = g @ weight.to(dtype)
        grad_a = grad_b = None
        if lora_a is not None:
            gha = (g @ lora_b.to(dtype)).mul_(ctx.scaling)
            grad_h.addmm_(gha, lora_a.to(dtype))
            if ctx.needs_input_grad[3]:
                h = (F.silu(gate) * up).reshape(-1, gate.shape[-1])  # the forward's bits again
                grad_a = (gha.t() @ h).to(lora_a.dtype)
            if ctx.needs_input_grad[4]:
                grad_b = (g.t() @ ha).mul_(ctx.scaling).to(lora_b.dtype)
        grad_h = grad_h.view(gate.shape)
        grad_up = grad_h * F.silu(gate) if ctx.needs_input_grad[1] else None
        grad_gate = torch.ops.aten.silu_backward(grad_h * up, gate) if ctx.needs_input_grad[0] else None
        return grad_gate, grad_up, None, grad_a, grad_b, None


def swiglu_down(mlp: nn.Module, gate: Tensor, up: Tensor) -> Optional[Tensor]:
    """``mlp.down_proj(mlp.act_fn(gate) * up)`` through ``SwiGLUDownFunction``, or None where it
    does not apply (another activation; a down projection that is not a plain ``nn.Linear`` or
    a LoRA layer with one vanilla adapter active, or with its adapters switched off)."""
    from .fused_lora import _servable_adapter

    if type(mlp.act_fn).__name__ not in SILU_MODULES:
        return None
    down = mlp.down_proj
    if isinstance(down, nn.Linear) and down.bias is None and not hasattr(down, "lora_A"):
        return SwiGLUDownFunction.apply(gate, up, down.weight, None, None, 1.0)
    if not hasattr(down, "lora_A") or down.disable_adapters:
        return None
    name = _servable_adapter(down)
    base = down.get_base_layer()
    if name is None or base.bias is not None:
        return None
    return SwiGLUDownFunction.apply(gate, up, base.weight, down.lora_A[name].weight, down.lora_B[name].weight,
                                    float(down.scaling[name]))


def _checkpointed_mixer_forward(self, *args, **kwargs):
    inner = self._atlas_mixer_forward
    if not (self.training and torch.is_grad_enabled()):
        return inner(*args, **kwargs)
    # built per call (a few modules to walk) so that a deep copy of the model replays its own adapters
    return checkpoint_keeping_adapter(tuner_layers(self))(inner, *args, **kwargs)


def mixer_of(layer: nn.Module) -> Optional[nn.Module]:
    """A decoder layer's token mixer: ``self_attn`` or ``linear_attn``."""
    for name in ("self_attn", "linear_attn"):
        module = getattr(layer, name, None)
        if isinstance(module, nn.Module):
            return module
    return None


def install_mixer_checkpoints(decoder_layers: Sequence[nn.Module], indices: Sequence[int]) -> int:
    """Run the token mixer of each layer in ``indices`` under its own checkpoint (module doc);
    the mixer's current forward (transformers' or an installed one) is what gets replayed.
    Returns how many mixers were wrapped."""
    count = 0
    for index in indices:
        mixer = mixer_of(decoder_layers[index])
        if mixer is None:
            raise ValueError(f"decoder layer {index} has no self_attn or linear_attn to checkpoint")
        mixer._atlas_mixer_forward = mixer.forward  # bound: the instance attribute if one was installed
        mixer.forward = MethodType(_checkpointed_mixer_forward, mixer)
        count += 1
    return count
