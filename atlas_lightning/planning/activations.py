"""Bytes a token costs inside one decoder layer: what autograd saves for the backward, and
what a no-grad forward holds at once. Pure arithmetic over a ``ModelShape``.

Counted for this project's path (``models/actor_critic.py``): a bf16 (or fp32) base, fused LoRA
(``models/fused_lora.py``: each adapted linear saves its input ``x``, shared by the linears that
read it, and ``x A^T``, ``rank`` wide), transformers' RMSNorm (an fp32 copy of its input), SwiGLU
MLP, FlashAttention-style kernels (flex / varlen sdpa save q, k, v, the output and an fp32
log-sum-exp per head). ``c`` is the compute dtype's bytes (2 for bf16).

Saved bytes per token, full-attention layer (``H`` hidden, ``I`` MLP, ``Q = heads x head_dim``,
``K = kv_heads x head_dim``, ``nh`` heads, ``r`` rank, ``n`` adapted linears)::

    norms        2 x 4H                      fp32 copies in the two RMSNorms
    linear inputs c (H + Q + H + I)          attention in, o_proj in, MLP in, down_proj in
    LoRA          c r n                      x A^T of each adapted linear
    q/k norms     4 (Q + K)                  fp32 copies (Qwen3, Qwen3.5)
    attention     c (Q + 2K) + c Q + 4 nh    rotated q, k, v; output; log-sum-exp
    output gate   2 c Q                      Qwen3.5: sigmoid(gate) and the gated product
    MLP           3 c I                      gate, silu(gate), up

Linear-attention (Gated DeltaNet) layer, ``Dk = value_heads x key_head_dim`` (q and k are
repeated to the value heads), ``Dv = value_heads x value_head_dim``, ``C`` conv channels,
``nv`` value heads, chunk 64; two kernel paths:

* ``fla`` (flash-linear-attention's varlen kernels, ``models/linear_attention.py``, what a
  production node runs): the kernel saves q, k, v and its gates in the compute dtype plus an
  ``nv x 64`` chunk matrix::

      c (2 Dk + Dv) + 4 nv 64 + 2 c Dv (gated norm) + c C (conv input) + c Dv (out_proj in)

* ``torch`` (transformers' reference fallback, when those packages are absent): fp32 copies
  of q, k, v at several stages, ``nv x 64`` chunk matrices and one ``nv x dk x dv`` recurrent
  state per 64 tokens, all saved::

      4 (8 Dk + 7 Dv) + 4 x 5 nv 64 + 4 nv dk dv / 64 + 14 Dv + 2 c C + c Dv

  each plus the layer's common part (norms, MLP, linear inputs, LoRA) as above.

Forward-only (no grad) passes hold, besides the residual stream, the largest set of tensors
alive at once inside a layer: for the MLP ``x``, gate, up and their product, ``c (H + 3I)``;
for attention ``4H + c (2Q + 3K) + 4 Q``; for linear attention the saved set above (its
fallback keeps every intermediate of a chunk alive in local variables).

Calibration (``SAVED_CALIBRATION``, ``FORWARD_CALIBRATION``): the full-attention counts are
analytic and were left alone: on an H200 (``tests/scale/h200_memory_check.json``, an 8B-shaped
model, 8,192 and 16,384 tokens without checkpointing) the whole update's peak came within 0.5
to 1.4 % of them. The torch fallback's linear-attention counts over-estimate: measured on the
27B shape's first 8 layers (transformers 5.17) the saved bytes were 0.83 to 0.87 of the count
(checkpointed and not) and a forward's working set 0.55 of it; those two factors are applied.
The ``fla`` path, measured on an H200 (``bench/results/run13-27b.json``, ``bench/NOTES.md``): the first
4 layers of the 27B shape (3 Gated DeltaNet on fla + 1 gated full attention, packed, lean
activations) at 46,950 tokens, critic + actor update without an optimizer step, peaked at
52.2 GiB with no layer checkpointed and 24.8 GiB with all of them; uncalibrated, the plan said
66.9 and 27.3. A factor of 0.64 on the fla layer's count reproduces the first (the second
becomes 26.8, +8%, the one-layer recompute transient being the full-attention layer's). The
same run measured a dense 8B layer's saved bytes at 0.54 of its count here: these formulas
predate lean activations (``models/lean_activations.py``: bf16 norm inputs, the MLP product
recomputed), which the factor for fla absorbs and the full-attention count does not, so kept
(uncheckpointed) dense layers are over-predicted, on the safe side. The fla forward working set
is still uncalibrated.

Who calls it: ``planning.estimate``.
"""

from __future__ import annotations

from .shapes import FULL, LINEAR, ModelShape

#: Measured over counted saved bytes, per layer kind and kernel path (module doc).
SAVED_CALIBRATION = {"full_attention": 1.0, "linear_attention:fla": 0.64, "linear_attention:torch": 0.85}
#: Measured over counted forward working set of a linear-attention layer (module doc).
FORWARD_CALIBRATION = {"linear_attention:fla": 1.0, "linear_attention:torch": 0.55}
CHUNK = 64


def _common(shape: ModelShape, c: int, rank: int, adapted: int) -> int:
    h, i = shape.hidden_size, shape.intermediate_size
    return 2 * 4 * h + c * (2 * h + i) + c * rank * adapted + 3 * c * i


def saved_bytes_per_token(shape: ModelShape, kind: str, *, c: int, rank: int, adapted: int,
                          linear_kernel: str = "fla") -> float:
    """Bytes autograd keeps per token for one layer of ``kind`` (module doc), calibrated."""
    common = _common(shape, c, rank, adapted)
    if kind == FULL:
        q, k = shape.q_width, shape.kv_width
        own = c * q  # o_proj input
        if shape.qk_norm:
            own += 4 * (q + k)
        own += c * (q + 2 * k) + c * q + 4 * shape.num_heads
        if shape.attn_output_gate:
            own += 2 * c * q
        return (common + own) * SAVED_CALIBRATION[FULL]
    if kind != LINEAR:
        raise ValueError(f"unknown layer kind {kind!r}")
    nv, dk, dv = shape.linear_num_value_heads, shape.linear_key_head_dim, shape.linear_value_head_dim
    big_k, big_v, conv = nv * dk, nv * dv, shape.linear_conv_dim
    if linear_kernel == "fla":
        own = c * (2 * big_k + big_v) + 4 * nv * CHUNK + 2 * c * big_v + c * conv + c * big_v
    elif linear_kernel == "torch":
        own = (4 * (8 * big_k + 7 * big_v) + 4 * 5 * nv * CHUNK + 4 * nv * dk * dv / CHUNK
               + 14 * big_v + 2 * c * conv + c * big_v)
    else:
        raise ValueError(f"linear attention kernel {linear_kernel!r} is not one of fla, torch")
    return (common + own) * SAVED_CALIBRATION[f"{LINEAR}:{linear_kernel}"]


def forward_bytes_per_token(shape: ModelShape, kind: str, *, c: int, rank: int, adapted: int,
                            linear_kernel: str = "fla") -> float:
    """Bytes per token alive at once inside one layer during a no-grad forward (module doc)."""
    h, i = shape.hidden_size, shape.intermediate_size
    mlp = c * (h + 3 * i)
    if kind == FULL:
        q, k = shape.q_width, shape.kv_width
        attention = 4 * h + c * (2 * q + 3 * k) + 4 * q + (c * 2 * q if shape.attn_output_gate else 0)
        return max(mlp, attention)
    key = f"{LINEAR}:{linear_kernel}"
    saved = saved_bytes_per_token(shape, kind, c=c, rank=rank, adapted=adapted, linear_kernel=linear_kernel)
    own = saved / SAVED_CALIBRATION[key] - _common(shape, c, rank, adapted)
    return max(mlp, own * FORWARD_CALIBRATION[key])
