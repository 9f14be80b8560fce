"""One autograd function per LoRA-wrapped linear: base matmul and low-rank path together.

peft's ``lora.Linear.forward`` (peft 0.21) computes ``base(x) + lora_B(lora_A(dropout(x))) *
scaling`` as separate autograd nodes, and first casts ``x`` to the adapter's dtype. With a
bf16 base and fp32 adapters (peft's default ``autocast_adapter_dtype``) that is a full-size
fp32 copy of every linear's input, fp32 matmuls (no bf16 tensor cores) and fp32
intermediates, all saved for the backward: measured on an H200 (``bench/NOTES.md``) it costs about a
third of an update's time. Here, for a vanilla LoRA adapter (no dropout, no DoRA, no
variant) the layer's forward is one ``torch.autograd.Function``:

    forward:  xa = x @ A^T                         (M, r)
              y  = x @ W^T (+ b);  y += s * xa @ B^T   (one GEMM with beta = 1)
    backward: gxa = s * g @ B                      (M, r)
              dx  = g @ W;  dx += gxa @ A          (one GEMM with beta = 1)
              dA  = gxa^T @ x,   dB = s * g^T @ xa

with ``A``, ``B`` cast to the input's dtype for the matmuls (the compute dtype: bf16 on
GPUs, exactly what FSDP2's ``param_dtype=bf16`` policy already does to them under sharding)
and gradients returned in the parameters' own dtype (fp32 masters stay fp32). Saved for the
backward: ``x`` (which the base matmul needs anyway) and ``xa`` (M x r); nothing in fp32.
The frozen base weight gets a gradient only if it requires one.

Numerics: the same function as peft's; in fp32 the results agree to rounding (the tests
hold it to 1e-5 against peft's forward and gradients). In bf16 the low-rank product is
rounded to bf16 like the rest of the layer (as under FSDP2 mixed precision).

Who calls it: ``ActorCritic`` (``install_fused_lora`` on its tuner layers, when
``fused_lora=True``). Layers it cannot serve (dropout, DoRA, several active adapters,
merged weights, non-``nn.Linear`` bases, extra forward arguments) keep peft's forward.
"""

from __future__ import annotations

from types import MethodType
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class LoraLinearFunction(torch.autograd.Function):
    """``y = x W^T + b + scaling * (x A^T) B^T`` with the low-rank path fused (module doc).
    Shapes: ``x (..., in)``, ``weight (out, in)``, ``bias (out,)`` or None, ``lora_a (r, in)``,
    ``lora_b (out, r)``; returns ``(..., out)`` in ``x``'s dtype."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], lora_a: Tensor, lora_b: Tensor, scaling: float):
        dtype = x.dtype
        x2 = x.reshape(-1, x.shape[-1])
        xa = x2 @ lora_a.to(dtype).t()
        y = F.linear(x2, weight.to(dtype), None if bias is None else bias.to(dtype))
        y.addmm_(xa, lora_b.to(dtype).t(), alpha=scaling)
        ctx.save_for_backward(x, weight, lora_a, lora_b, xa)
        ctx.scaling = scaling
        ctx.has_bias = bias is not None
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight, lora_a, lora_b, xa = ctx.saved_tensors
        need_x, need_w, need_b, need_a, need_lb, _ = ctx.needs_input_grad
        dtype = x.dtype
        g = grad_out.reshape(-1, grad_out.shape[-1]).to(dtype)
        x2 = x.reshape(-1, x.shape[-1])
        a, b = lora_a.to(dtype), lora_b.to(dtype)
        gxa = (g @ b).mul_(ctx.scaling)
        grad_x = grad_w = grad_bias = grad_a = grad_b = None
        if need_x:
            grad_x = (g @ weight.to(dtype)).addmm_(gxa, a).view(x.shape)
        if need_w:
            grad_w = (g.t() @ x2).to(weight.dtype)
        if need_b and ctx.has_bias:
            grad_bias = g.sum(0).to(weight.dtype)
        if need_a:
            grad_a = (gxa.t() @ x2).to(lora_a.dtype)
        if need_lb:
            grad_b = (g.t() @ xa).mul_(ctx.scaling).to(lora_b.dtype)
        return grad_x, grad_w, grad_bias, grad_a, grad_b, None


def _servable_adapter(layer) -> Optional[str]:
    """The single active vanilla adapter this layer can run fused, or None (peft's path)."""
    if layer.merged or not isinstance(layer.get_base_layer(), nn.Linear) or getattr(layer, "fan_in_fan_out", False):
        return None
    active = [name for name in layer.active_adapters if name in layer.lora_A]
    if len(active) != 1:
        return None
    name = active[0]
    if name in getattr(layer, "lora_variant", {}) or layer.use_dora.get(name, False):
        return None
    if layer.lora_bias.get(name, False) or not isinstance(layer.lora_dropout[name], nn.Identity):
        return None
    return name


def _fused_forward(self, x: Tensor, *args, **kwargs) -> Tensor:
    """Replacement ``forward`` of a peft ``lora.Linear`` (bound to the layer)."""
    if args or kwargs:
        return type(self).forward(self, x, *args, **kwargs)
    if self.disable_adapters and not self.merged:
        return self.base_layer(x)
    name = _servable_adapter(self)
    if name is None:
        return type(self).forward(self, x)
    base = self.base_layer
    return LoraLinearFunction.apply(
        x, base.weight, base.bias, self.lora_A[name].weight, self.lora_B[name].weight, float(self.scaling[name])
    )


def install_fused_lora(layers: Iterable[nn.Module]) -> int:
    """Give every peft ``lora.Linear`` in ``layers`` the fused forward (an instance attribute,
    so peft's class and other models are untouched). Returns how many layers got it."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    count = 0
    for layer in layers:
        if type(layer) is LoraLinear:
            layer.forward = MethodType(_fused_forward, layer)
            count += 1
    return count
