"""Recomputation finer than a decoder layer: per layer, ``layer`` (transformers' checkpoint of
the whole layer), ``mixer``, ``mlp`` or ``none`` (``RECOMPUTE``).

Whole-layer checkpointing keeps 2 bytes x hidden a token and replays the whole layer (for the
8B shape ~435 MFLOP a token of ~920 useful); an uncheckpointed lean layer keeps ~85 KB a token
(H200, ``bench/NOTES.md``), two thirds of it the MLP's ``gate(x)`` and ``up(x)``. Finer tools between them:

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
* ``SwiGLUMLPFunction`` (policy ``mlp``): the whole SwiGLU MLP with LoRA on its three
  projections as one function that saves only its input and the three ``M x r`` low-rank
  products; the backward recomputes ``gate(x)`` and ``up(x)`` (two GEMMs, ~200 MFLOP a token
  for the 8B shape) but not the down projection, for ~2 x MLP width x 2 bytes a token less.

Both SwiGLU functions take ``fused``: the product and its backward as liger-kernel's one-pass
kernels (``fused_kernels``; set where ``lean_activations.install_fused_kernels`` marked the MLP), the backward
writing the two gradients over ``gate``/``up`` (saved or replayed, read by nothing else).

Who calls it: ``lean_activations`` (the SwiGLU tail), ``ActorCritic`` (``layer_recompute``).
"""

from __future__ import annotations

from types import MethodType
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .adapter_switch import checkpoint_keeping_adapter, tuner_layers
from .fused_kernels import fused_swiglu

#: Activation modules whose function is ``silu`` (what ``SwiGLUDownFunction`` differentiates).
SILU_MODULES = ("SiLU", "SiLUActivation")
#: Per-layer recomputation policies, most memory first (module doc).
RECOMPUTE = ("none", "mixer", "mlp", "layer")


def _lora_linear(x: Tensor, weight: Tensor, a: Optional[Tensor], b: Optional[Tensor], scaling: float):
    """``(x W^T + s (x A^T) B^T, x A^T)`` as ``fused_lora`` computes them; ``x (M, in)``."""
    y = F.linear(x, weight.to(x.dtype))
    xa = None
    if a is not None:
        xa = x @ a.to(x.dtype).t()
        y.addmm_(xa, b.to(x.dtype).t(), alpha=scaling)
    return y, xa


def _lora_linear_backward(grad: Tensor, x: Tensor, xa: Optional[Tensor], weight: Tensor, a, b, scaling: float,
                          need_a: bool, need_b: bool):
    """``(dx, dA, dB)`` of ``_lora_linear`` (the formulas of ``fused_lora.LoraLinearFunction``)."""
    dtype = grad.dtype
    dx = grad @ weight.to(dtype)
    da = db = None
    if a is not None:
        gxa = (grad @ b.to(dtype)).mul_(scaling)
        dx.addmm_(gxa, a.to(dtype))
        if need_a:
            da = (gxa.t() @ x).to(a.dtype)
        if need_b:
            db = (grad.t() @ xa).mul_(scaling).to(b.dtype)
    return dx, da, db


class SwiGLUMLPFunction(torch.autograd.Function):
    """``down(silu(gate(x)) * up(x))``, each projection ``W`` plus an optional LoRA ``(A, B, s)``
    (``None`` A/B: plain). Saves ``x`` and the three ``x A^T`` products; the backward recomputes
    ``gate(x)`` and ``up(x)`` with the forward's ops (same bits), never the down projection."""

    @staticmethod
    def forward(ctx, x: Tensor, wg, ag, bg, wu, au, bu, wd, ad, bd, sg: float, su: float, sd: float,
                fused: bool = False) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        gate, ga = _lora_linear(x2, wg, ag, bg, sg)
        up, ua = _lora_linear(x2, wu, au, bu, su)
        y, ha = _lora_linear(_silu_mul(gate, up, fused), wd, ad, bd, sd)
        ctx.save_for_backward(x, ga, ua, ha)
        ctx.params = (wg, ag, bg, wu, au, bu, wd, ad, bd)  # parameters: held on ctx, not as saved activations
        ctx.scalings = (sg, su, sd)
        ctx.fused = fused
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, ga, ua, ha = ctx.saved_tensors
        wg, ag, bg, wu, au, bu, wd, ad, bd = ctx.params
        sg, su, sd = ctx.scalings
        need = ctx.needs_input_grad
        x2 = x.reshape(-1, x.shape[-1])
        grad = grad_out.reshape(-1, grad_out.shape[-1]).to(x.dtype)
        # the replay this function bounds: gate and up again, exactly as forward computed them
        gate = F.linear(x2, wg.to(x.dtype))
        if ag is not None:
            gate.addmm_(ga, bg.to(x.dtype).t(), alpha=sg)
        up = F.linear(x2, wu.to(x.dtype))
        if au is not None:
            up.addmm_(ua, bu.to(x.dtype).t(), alpha=su)
        if ctx.fused:  # fused_kernels: one pass each way; the gradients overwrite the replayed gate and up
            from .fused_kernels import silu_mul_backward_

            grad_h, dad, dbd = _lora_linear_backward(grad, _silu_mul(gate, up, True), ha, wd, ad, bd, sd, need[8],
                                                     need[9])
            del grad
            grad_gate, grad_up = silu_mul_backward_(gate, up, grad_h)
            del grad_h
        else:
            act = F.silu(gate)
            grad_h, dad, dbd = _lora_linear_backward(grad, act * up, ha, wd, ad, bd, sd, need[8], need[9])
            del grad
            grad_up = grad_h * act
            del act
            grad_gate = torch.ops.aten.silu_backward(grad_h * up, gate)
            del grad_h, up, gate
        dx, dag, dbg = _lora_linear_backward(grad_gate, x2, ga, wg, ag, bg, sg, need[2], need[3])
        del grad_gate
        dxu, dau, dbu = _lora_linear_backward(grad_up, x2, ua, wu, au, bu, su, need[5], need[6])
        dx.add_(dxu)
        return dx.view(x.shape), None, dag, dbg, None, dau, dbu, None, dad, dbd, None, None, None, None


def _silu_mul(gate: Tensor, up: Tensor, fused: bool) -> Tensor:
    """``silu(gate) * up``: PyTorch's two kernels, or ``fused_kernels.silu_mul``'s one pass."""
    if fused:
        from .fused_kernels import silu_mul

        return silu_mul(gate, up)
    return F.silu(gate) * up


def _projection(module: nn.Module):
    """``(W, A, B, scaling)`` of a plain bias-free linear or a LoRA layer with one vanilla adapter
    active (A, B None when its adapters are off), or None when it is neither."""
    from .fused_lora import _servable_adapter

    if isinstance(module, nn.Linear) and module.bias is None and not hasattr(module, "lora_A"):
        return module.weight, None, None, 1.0
    if not hasattr(module, "lora_A"):
        return None
    base = module.get_base_layer()
    if not isinstance(base, nn.Linear) or base.bias is not None:
        return None
    if module.disable_adapters:
        return base.weight, None, None, 1.0
    name = _servable_adapter(module)
    if name is None:
        return None
    return base.weight, module.lora_A[name].weight, module.lora_B[name].weight, float(module.scaling[name])


def _recomputed_mlp_forward(self, x: Tensor) -> Tensor:
    parts = [_projection(m) for m in (self.gate_proj, self.up_proj, self.down_proj)]
    if not (self.training and torch.is_grad_enabled()) or any(p is None for p in parts) \
            or type(self.act_fn).__name__ not in SILU_MODULES:
        return type(self).forward(self, x)
    (wg, ag, bg, sg), (wu, au, bu, su), (wd, ad, bd, sd) = parts
    return SwiGLUMLPFunction.apply(x, wg, ag, bg, wu, au, bu, wd, ad, bd, sg, su, sd, fused_swiglu(self))


def install_mlp_recompute(decoder_layers: Sequence[nn.Module], indices: Sequence[int]) -> int:
    """Policy ``mlp`` for the layers in ``indices``: their SwiGLU MLP runs as
    ``SwiGLUMLPFunction`` (in training with gradients; otherwise, or for projections it cannot
    serve, transformers' forward). Returns how many MLPs got it."""
    for index in indices:
        mlp = getattr(decoder_layers[index], "mlp", None)
        if mlp is None or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            raise ValueError(f"decoder layer {index} has no SwiGLU mlp (gate_proj, up_proj, down_proj, act_fn)")
        mlp.forward = MethodType(_recomputed_mlp_forward, mlp)
    return len(indices)


class SwiGLUDownFunction(torch.autograd.Function):
    """``y = h W^T + scaling * (h A^T) B^T`` with ``h = silu(gate) * up``; ``lora_a``/``lora_b``
    None for a plain projection. Shapes: ``gate``, ``up (..., I)``, ``weight (H, I)``,
    ``lora_a (r, I)``, ``lora_b (H, r)``; returns ``(..., H)`` in ``gate``'s dtype."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor, weight: Tensor, lora_a: Optional[Tensor], lora_b: Optional[Tensor],
                scaling: float, fused: bool = False) -> Tensor:
        y, ha = _lora_linear(_silu_mul(gate, up, fused).reshape(-1, gate.shape[-1]), weight, lora_a, lora_b, scaling)
        ctx.save_for_backward(gate, up, ha)
        ctx.params = (weight, lora_a, lora_b)  # parameters: held on ctx, not as saved activations
        ctx.scaling = scaling
        ctx.fused = fused
        return y.view(*gate.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        gate, up, ha = ctx.saved_tensors
        weight, lora_a, lora_b = ctx.params
        if ctx.fused:  # fused_kernels: one pass each way; the gradients overwrite the saved gate and up
            from .fused_kernels import silu_mul_backward_

            grad = grad_out.reshape(-1, grad_out.shape[-1]).to(gate.dtype)
            grad_h, grad_a, grad_b = _lora_linear_backward(grad, _silu_mul(gate, up, True).reshape(-1, gate.shape[-1]),
                                                           ha, weight, lora_a, lora_b, ctx.scaling,
                                                           ctx.needs_input_grad[3], ctx.needs_input_grad[4])
            del grad
            grad_gate, grad_up = silu_mul_backward_(gate, up, grad_h.view(gate.shape))
            need = ctx.needs_input_grad
            return grad_gate if need[0] else None, grad_up if need[1] else None, None, grad_a, grad_b, None, None
        act = F.silu(gate)
        h = (act * up).reshape(-1, gate.shape[-1])  # the forward's bits again, for the LoRA A gradient
        grad = grad_out.reshape(-1, grad_out.shape[-1]).to(gate.dtype)
        grad_h, grad_a, grad_b = _lora_linear_backward(grad, h, ha, weight, lora_a, lora_b, ctx.scaling,
                                                       ctx.needs_input_grad[3], ctx.needs_input_grad[4])
        grad_h = grad_h.view(gate.shape)
        grad_up = grad_h * act if ctx.needs_input_grad[1] else None
        grad_gate = torch.ops.aten.silu_backward(grad_h * up, gate) if ctx.needs_input_grad[0] else None
        return grad_gate, grad_up, None, grad_a, grad_b, None, None


def swiglu_down(mlp: nn.Module, gate: Tensor, up: Tensor) -> Optional[Tensor]:
    """``mlp.down_proj(mlp.act_fn(gate) * up)`` through ``SwiGLUDownFunction``, or None where it
    does not apply (another activation; a down projection that is neither a plain bias-free
    ``nn.Linear`` nor a LoRA layer with one vanilla adapter active or its adapters off)."""
    down = _projection(mlp.down_proj)
    if type(mlp.act_fn).__name__ not in SILU_MODULES or down is None:
        return None
    weight, a, b, scaling = down
    return SwiGLUDownFunction.apply(gate, up, weight, a, b, scaling, fused_swiglu(mlp))


def _checkpointed_mixer_forward(self, *args, **kwargs):
    inner = self._atlas_mixer_forward
    if not (self.training and torch.is_grad_enabled() and self._atlas_mixer_active):
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
        mixer._atlas_mixer_active = True  # ActorCritic.use_recompute_for turns it off and on
        mixer.forward = MethodType(_checkpointed_mixer_forward, mixer)
        count += 1
    return count
