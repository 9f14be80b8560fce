"""Fused memory-bound kernels of the decoder layers: the config key ``model.elementwise_kernels``.

Why: a profiled micro-step of the dense 8B-shaped update (H200, ``bench/NOTES.md`` run 13) spent
26% of its device time in element-wise kernels and 11% in copies: the RMSNorms' fp32 arithmetic
(a cast, a square, a mean, an rsqrt, two products and a cast back, each a pass over the tensor,
again in the backward), the rotary embedding (``rotate_half``'s ``torch.cat`` and four products)
and the SwiGLU product with its backward. Each is one pass over its tensors when fused.

* ``liger``: liger-kernel's Triton kernels (an optional dependency, extra ``liger``), each one
  pass: ``LigerRMSNormFunction`` for every RMSNorm of the decoder layers (casting mode
  ``llama`` for ``weight * (x * rstd).to(dtype)``, ``gemma`` with offset 1 for Qwen3.5's
  ``(x * rstd) * (1 + weight)``; it saves ``x`` in its own dtype and one fp32 ``rstd`` a row,
  as ``lean_activations.RMSNormFunction`` does), its SiLU-times-up forward and backward inside
  ``recompute.SwiGLUDownFunction`` / ``SwiGLUMLPFunction`` (the backward writes the two
  gradients over the saved ``gate``/``up``, which nothing else reads), and its RoPE kernel for
  Qwen3's attention (q and k rotated in place in one launch; ``attention_forward``).
  Results equal the torch path within bf16 rounding (fp32 statistics in registers, not in
  memory; ``tests/models/test_fused_kernels.py`` compares them on a GPU).
* ``torch``: the PyTorch ops (``lean_activations``, ``recompute``, transformers' attention):
  the only path on CPUs, unchanged.
* ``auto``: ``liger`` where liger-kernel and Triton import and the model sits on a CUDA
  device, else ``torch``. ``ActorCritic.elementwise_kernels`` says which ran; the benchmark
  reports it.

Contract: this module holds the kernels and the choice (``resolve``) and imports nothing of
this package; ``lean_activations.install_fused_kernels(decoder_layers)`` patches a model's layers
to use them (``recompute`` and ``lean_activations`` call the kernels).

Pure Python until a kernel is called: liger-kernel and Triton are imported only then (and by
``liger_problem``), so the CPU install, which has neither, never imports them.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch
from torch import Tensor, nn

from .kernel_choice import choose, import_problem

KERNELS = ("auto", "liger", "torch")
KEY = "model.elementwise_kernels"
#: What the liger path imports; all must load for ``liger`` to be usable.
LIGER_MODULES = ("liger_kernel.ops.rms_norm", "liger_kernel.ops.swiglu", "liger_kernel.ops.rope")
#: Attention classes whose forward ``attention_forward`` reproduces (q/k norm, rotary, attention, o).
ROTARY_ATTENTIONS = ("Qwen3Attention",)


@lru_cache(maxsize=2)
def liger_problem(import_modules: bool = True) -> Optional[str]:
    """``None`` when liger-kernel is usable here, else the reason."""
    return import_problem((("triton", "Triton"), ("liger_kernel", "liger-kernel (extra `liger`)")), LIGER_MODULES,
                          "liger-kernel", import_modules)


def resolve(requested: str, device_type: Optional[str], *, import_modules: bool = True) -> str:
    """``liger`` or ``torch`` for ``requested`` (one of ``KERNELS``) on a device of type
    ``device_type`` (``cuda``, ``cpu``; None: not known, taken as a GPU). Raises ``ValueError``
    naming the key when ``liger`` is asked for and cannot run here (``kernel_choice.choose``)."""
    return choose(KEY, requested, KERNELS, device_type, lambda: liger_problem(import_modules))


# ---------------------------------------------------------------------------- kernels
def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: bool) -> Tensor:
    """``lean_activations.RMSNormFunction``'s function in one Triton pass each way (module doc).
    ``in_place=False``: the incoming gradient is never overwritten (autograd may share it)."""
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    if offset:
        return LigerRMSNormFunction.apply(x, weight, eps, 1.0, "gemma", False, None)
    return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", False, None)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` (silu in fp32, rounded to the input dtype, times ``up``): one pass."""
    from liger_kernel.ops.swiglu import swiglu_forward

    return swiglu_forward(gate.contiguous(), up.contiguous())[2]


def silu_mul_backward_(gate: Tensor, up: Tensor, grad_h: Tensor) -> tuple[Tensor, Tensor]:
    """``(d gate, d up)`` of ``silu(gate) * up`` for ``grad_h``, written OVER ``gate`` and ``up``
    (contiguous, not read afterwards by anyone) in one pass; returns them. Their autograd
    version is bumped (a Triton write is invisible to autograd): a second backward through the
    same graph (``retain_graph=True``) then stops with autograd's in-place error instead of
    reading gradients as activations."""
    from liger_kernel.ops.swiglu import swiglu_backward

    if not (gate.is_contiguous() and up.is_contiguous()):
        raise ValueError("silu_mul_backward_ writes over gate and up: both must be contiguous")
    # bumped before the write: the gradients it returns are views of gate and up made after it
    torch.autograd.graph.increment_version((gate, up))
    return swiglu_backward(gate, up, grad_h.contiguous())


def apply_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin)`` (``q (B, Hq, L, D)``, ``cos (B, L, D)``
    with ``cos = cat(f, f)``): both rotated in place (their buffers) in one launch."""
    from liger_kernel.ops.rope import LigerRopeFunction

    return LigerRopeFunction.apply(q, k, cos, sin)


def mlp_forward(self, x: Tensor) -> Tensor:
    """transformers' SwiGLU MLP ``down(silu(gate(x)) * up(x))`` with the product (and its
    backward, which overwrites the saved ``gate(x)`` and ``up(x)``) fused."""
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return self.down_proj(LigerSiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x)))


def attention_forward(self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor],
                      attention_mask: Optional[Tensor], past_key_values=None, **kwargs):
    """``Qwen3Attention.forward`` (transformers 5.17-5.19) with the rotary embedding fused (the
    q/k norms are fused through their own patched forwards)."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query_states, key_states = apply_rotary(query_states, key_states, cos, sin)
    if past_key_values is not None:
        key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
    eager = getattr(sys.modules[type(self).__module__], "eager_attention_forward", None)
    implementation = self.config._attn_implementation
    attention_interface = ALL_ATTENTION_FUNCTIONS[implementation] if implementation in ALL_ATTENTION_FUNCTIONS else eager
    attn_output, attn_weights = attention_interface(
        self, query_states, key_states, value_states, attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling, sliding_window=getattr(self, "sliding_window", None), **kwargs,
    )
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights


def fused_swiglu(module: nn.Module) -> bool:
    """Whether ``lean_activations.install_fused_kernels`` marked this MLP."""
    return bool(getattr(module, "_atlas_fused_swiglu", False))


def torch_rotary_reference(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """transformers' rotary (for tests): ``q * cos + rotate_half(q) * sin``."""
    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
