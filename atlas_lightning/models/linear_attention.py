"""Gated DeltaNet (linear-attention) layers of Qwen3.5/3.6 over packed rows, without padding.

transformers' ``Qwen3_5GatedDeltaNet.forward`` runs its causal conv1d and chunked gated delta
rule over whole rows: in a packed row the conv window and the recurrent state would carry from
one sequence into the next (measured: 4e-2 logit error on a tiny Qwen3.5). This module gives
each such layer a forward that reads the packed boundaries from the decoder's kwargs, which
``ActorCritic`` passes on the packed layout and gradient checkpointing passes again on replay:

* ``attention.SEQ_LENS_KWARG``: the sequence lengths, a tuple of Python ints;
* ``CU_SEQLENS_KWARG``: the same boundaries as an ``(n + 1,)`` int64 tensor on the device.

The layer then computes, for ``x (1, T, hidden)`` (shapes for the 27B: 16 key heads and 48
value heads of 128, conv over ``C = 2 * 16 * 128 + 48 * 128`` channels)::

    qkv, z, b, a = in_proj_qkv(x), in_proj_z(x), in_proj_b(x), in_proj_a(x)     packed, LoRA
    qkv = silu(causal_conv1d(qkv))                                    per sequence
    q, k, v = split(qkv);  beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)
    o = gated_delta_rule(l2norm(q), l2norm(k), v, g, beta)            per sequence, zero state
    out = out_proj(rmsnorm(o) * weight * silu(z))                     packed, LoRA

Two kernel paths (``linear_kernels.py`` chooses):

* ``fla``: flash-linear-attention's varlen kernels, one launch per op for the whole row
  (``cu_seqlens``; the host copy of the boundaries is passed too so that no kernel call reads
  them back from the device). q and k keep their 16 heads: fla's grouped value attention maps
  value head ``h`` to key head ``h // 3`` as transformers' ``repeat_interleave`` does. The
  gated norm is fla's fused ``rms_norm_gated``.
* ``torch``: transformers' own reference functions, run on the row scattered into right-padded
  ``(n, L_max)`` for the conv and the delta rule only (both are causal, so right padding never
  reaches a real token), gathered back; the projections and the norm stay packed. The
  reference functions are taken unwrapped (``inspect.unwrap``): transformers swaps in fla's
  kernel where the package imports, and this path must stay the reference.

Without the kwargs (the padded layout, a plain forward) the module's own forward runs.
Numerics: the fla path agrees with transformers run one sequence at a time within bf16
rounding; the torch path to fp32 rounding (``tests/models/test_linear_attention.py``).

Who calls it: ``ActorCritic`` (``install_packed_linear_attention`` on its decoder layers).
"""

from __future__ import annotations

import inspect
from types import MethodType
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import SEQ_LENS_KWARG

CU_SEQLENS_KWARG = "atlas_cu_seqlens"
#: transformers' Gated DeltaNet classes whose forward this module replaces.
GATED_DELTA_NETS = ("Qwen3_5GatedDeltaNet", "Qwen3_5TextGatedDeltaNet", "Qwen3NextGatedDeltaNet")


def linear_attention_modules(decoder_layers: Sequence[nn.Module]) -> list[nn.Module]:
    """The Gated DeltaNet modules of ``decoder_layers`` (``layer.linear_attn``), in order."""
    found = []
    for layer in decoder_layers:
        module = getattr(layer, "linear_attn", None)
        if module is not None and type(module).__name__ in GATED_DELTA_NETS:
            found.append(module)
    return found


def reference_functions(module: nn.Module):
    """transformers' pure-torch ``(causal_conv1d_fn, torch_chunk_gated_delta_rule)`` of the
    modeling file that defines ``module``'s class, unwrapped from any kernel substitution."""
    modeling = inspect.getmodule(type(module))
    conv = inspect.unwrap(getattr(modeling, "causal_conv1d_fn"))
    rule = inspect.unwrap(getattr(modeling, "torch_chunk_gated_delta_rule"))
    return conv, rule


def _gate_and_beta(module: nn.Module, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    # transformers' expressions, fp32 for the decay (bf16's exp would lose the small gates)
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    return g, b.sigmoid()


def _split_heads(module: nn.Module, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    batch, length, _ = qkv.shape
    q, k, v = torch.split(qkv, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    return (q.reshape(batch, length, -1, module.head_k_dim), k.reshape(batch, length, -1, module.head_k_dim),
            v.reshape(batch, length, -1, module.head_v_dim))


class _Padding:
    """Index maps between a packed row of ``T`` tokens and right-padded ``(n, L_max)``."""

    def __init__(self, seq_lens: Sequence[int], cu_seqlens: Tensor) -> None:
        self.n, self.width = len(seq_lens), max(seq_lens)
        total = int(sum(seq_lens))
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        sequence = torch.repeat_interleave(torch.arange(self.n, device=cu_seqlens.device), lengths, output_size=total)
        position = torch.arange(total, device=cu_seqlens.device) - cu_seqlens[:-1][sequence]
        self.flat = sequence * self.width + position  # packed token t -> slot in (n * L_max)

    def pad(self, x: Tensor) -> Tensor:
        """``(1, T, ...)`` -> ``(n, L_max, ...)``, zeros after each sequence."""
        out = x.new_zeros((self.n * self.width, *x.shape[2:]))
        return out.index_copy(0, self.flat, x[0]).view(self.n, self.width, *x.shape[2:])

    def unpad(self, x: Tensor) -> Tensor:
        """``(n, L_max, ...)`` -> ``(1, T, ...)``."""
        return x.reshape(self.n * self.width, *x.shape[2:]).index_select(0, self.flat).unsqueeze(0)


def _torch_mixer(module: nn.Module, qkv: Tensor, a: Tensor, b: Tensor, seq_lens, cu_seqlens: Tensor) -> Tensor:
    """Conv and delta rule per sequence with transformers' reference code; ``(1, T, Hv, Dv)``."""
    conv_fn, rule = reference_functions(module)
    padding = _Padding(seq_lens, cu_seqlens)
    mixed = conv_fn(padding.pad(qkv).transpose(1, 2), module.conv1d.weight.squeeze(1), module.conv1d.bias,
                    activation=module.activation).transpose(1, 2)
    q, k, v = _split_heads(module, mixed)
    g, beta = _gate_and_beta(module, padding.pad(a), padding.pad(b))
    if module.num_v_heads // module.num_k_heads > 1:
        q = q.repeat_interleave(module.num_v_heads // module.num_k_heads, dim=2)
        k = k.repeat_interleave(module.num_v_heads // module.num_k_heads, dim=2)
    out, _ = rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
    return padding.unpad(out)


def _fla_mixer(module: nn.Module, qkv: Tensor, a: Tensor, b: Tensor, seq_lens, cu_seqlens: Tensor) -> Tensor:
    """Conv and delta rule with flash-linear-attention's varlen kernels; ``(1, T, Hv, Dv)``."""
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    cu_cpu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.long)
    mixed, _ = causal_conv1d(qkv, module.conv1d.weight.squeeze(1), module.conv1d.bias, activation=module.activation,
                             cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_cpu)
    q, k, v = _split_heads(module, mixed)
    g, beta = _gate_and_beta(module, a, b)
    out, _ = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True,
                                    cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_cpu)
    return out


def _gated_norm(module: nn.Module, core: Tensor, z: Tensor, kernel: str) -> Tensor:
    flat_core, flat_z = core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim)
    if kernel == "fla":
        from fla.modules.norm.fused_norm_gate import rms_norm_gated

        return rms_norm_gated(flat_core, flat_z, module.norm.weight, None, activation="swish",
                              eps=module.norm.variance_epsilon)
    return module.norm(flat_core, flat_z)


def _packed_forward(self, hidden_states: Tensor, cache_params=None, attention_mask: Optional[Tensor] = None, **kwargs):
    """Replacement ``forward`` of a Gated DeltaNet module (bound to it; module doc)."""
    seq_lens, cu_seqlens = kwargs.get(SEQ_LENS_KWARG), kwargs.get(CU_SEQLENS_KWARG)
    if seq_lens is None or cu_seqlens is None or cache_params is not None:
        return type(self).forward(self, hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
    batch, length, _ = hidden_states.shape
    if batch != 1 or sum(seq_lens) != length:
        raise ValueError(f"packed Gated DeltaNet: {SEQ_LENS_KWARG} sums to {sum(seq_lens)} tokens, the row has shape "
                         f"{tuple(hidden_states.shape[:2])} (expected batch 1 and the same length)")
    qkv = self.in_proj_qkv(hidden_states)
    z = self.in_proj_z(hidden_states)
    b, a = self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)
    mixer = _fla_mixer if self._atlas_kernel == "fla" else _torch_mixer
    core = mixer(self, qkv, a, b, seq_lens, cu_seqlens)
    out = _gated_norm(self, core, z, self._atlas_kernel)
    return self.out_proj(out.reshape(batch, length, -1))


def install_packed_linear_attention(decoder_layers: Sequence[nn.Module], kernel: str) -> int:
    """Give every Gated DeltaNet of ``decoder_layers`` the packed forward with ``kernel``
    (``fla`` or ``torch``), as an instance attribute. Returns how many modules got it."""
    if kernel not in ("fla", "torch"):
        raise ValueError(f"linear attention kernel {kernel!r} is not one of fla, torch")
    modules = linear_attention_modules(decoder_layers)
    if kernel == "fla" and modules:
        import importlib

        from .fla_tuning import pin_token_keys
        from .linear_kernels import FLA_MODULES

        for name in FLA_MODULES:
            importlib.import_module(name)
        pin_token_keys()  # a new micro-batch length must not re-run Triton's autotuning
    for module in modules:
        module._atlas_kernel = kernel
        module.forward = MethodType(_packed_forward, module)
    return len(modules)
