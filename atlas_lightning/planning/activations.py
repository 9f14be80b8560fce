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
becomes 26.8, +8%, the one-layer recompute transient being the full-attention layer's). These
counts predate lean activations (``models/lean_activations.py``: bf16 norm inputs, the MLP product
recomputed); they now size only the replay of a whole checkpointed layer, and what a kept layer
saves is counted by part, lean or not (below: "By policy"; the fla part needs no factor there).
The fla forward working set is still uncalibrated.

By policy (``layer_parts``; ``models/recompute.py``'s ``layer``, ``mixer``, ``mlp``, ``none``): the
count above is a layer of transformers' own path, which the replay of a checkpointed layer runs
(its MLP tail is not lean) and which stays the replay's transient. A layer kept out of whole-layer
checkpointing is counted by part, each part what one policy replays instead of saving:

    common    2 norms + c (H + H) + c r n      the two RMSNorms' inputs, the mixer's and the
                                               MLP's inputs, LoRA's x A^T
    mixer     the layer's own part above       q/k norms, attention or Gated DeltaNet tensors,
                                               o_proj / out_proj input (``mixer`` replays it)
    gate_up   2 c I                            gate(x), up(x) (``mlp`` replays them)
    tail      2 c I                            silu(gate) and the product: saved only where the
                                               MLP tail is not lean

with a norm's input ``c x width + 4`` (lean: its own dtype and an fp32 rstd a row) or ``4 x
width`` (transformers' fp32 copy). ``none`` keeps all four, ``mixer`` all but the mixer's (its
checkpoint keeps the mixer's input, already in common), ``mlp`` all but gate_up and the tail (its
function saves the MLP's input and the low-rank products only). Lean tails (``lean_activations``
with gradient checkpointing on) apply to ``none`` and ``mixer`` layers. Without lean activations
the four parts sum to the count above, calibration aside. What a replay holds at once
(``replayed``): the whole layer's count for ``layer``; for the others a kept MLP's backward,
``MLP_BACKWARD x gate_up`` (gate(x), up(x) and their two gradients), or the mixer's part where
``mixer`` replays more. Checked against run 13's H200 peaks (``bench/results/run13-dense.json``:
the dense 8B's first 4 layers at 46,950 tokens, critic + actor, every layer under one policy;
``tests/bench/test_plan_check.py``): ``none`` 32.9 GiB planned for 32.2 measured, ``mixer`` 26.1
for 25.3, ``mlp`` 24.3 for 23.6, ``layer`` 17.3 for 15.1; the 27B's 3 + 1 layers on fla with none
checkpointed 55.1 for 52.2. With ``MLP_BACKWARD`` 1 (the gradients alone) the three kept policies
came 4-6% below their peaks. The 36-layer mixed plans (runs 13 and 15: 2-4 ``layer``, 31-32
``mixer``, 1-2 ``mlp`` at 16K-token micro-batches) are planned 2-7% above (the plan holds both
adapters' optimizer states, the benchmark the actor's alone). ``PART_CALIBRATION``:
the torch fallback's factor, kept on every part; the fla parts needed none.

Who calls it: ``planning.estimate``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .shapes import FULL, LINEAR, ModelShape

#: Measured over counted saved bytes, per layer kind and kernel path (module doc).
SAVED_CALIBRATION = {"full_attention": 1.0, "linear_attention:fla": 0.64, "linear_attention:torch": 0.85}
#: Measured over counted bytes of a kept layer's parts, per kernel path (module doc, "By policy").
PART_CALIBRATION = {FULL: 1.0, f"{LINEAR}:fla": 1.0, f"{LINEAR}:torch": SAVED_CALIBRATION[f"{LINEAR}:torch"]}
#: Measured over counted forward working set of a linear-attention layer (module doc).
FORWARD_CALIBRATION = {"linear_attention:fla": 1.0, "linear_attention:torch": 0.55}
CHUNK = 64
#: The recompute policies (``models/recompute.py``), from the least memory kept to the most.
POLICIES = ("layer", "mixer", "mlp", "none")
#: A kept MLP's backward holds gate(x) and up(x) and their two gradients at once (module doc).
MLP_BACKWARD = 2.0


def _common(shape: ModelShape, c: int, rank: int, adapted: int) -> int:
    h, i = shape.hidden_size, shape.intermediate_size
    return 2 * 4 * h + c * (2 * h + i) + c * rank * adapted + 3 * c * i


def saved_bytes_per_token(shape: ModelShape, kind: str, *, c: int, rank: int, adapted: int,
                          linear_kernel: str = "fla") -> float:
    """Bytes autograd keeps per token for one layer of ``kind`` (module doc), calibrated."""
    own = _mixer_bytes(shape, kind, c=c, linear_kernel=linear_kernel, lean=False)
    key = FULL if kind == FULL else f"{LINEAR}:{linear_kernel}"
    return (_common(shape, c, rank, adapted) + own) * SAVED_CALIBRATION[key]


def _mixer_bytes(shape: ModelShape, kind: str, *, c: int, linear_kernel: str, lean: bool) -> float:
    """The layer's own saved bytes a token, its token mixer's (module doc: "own part"; "mixer")."""
    if kind == FULL:
        q, k = shape.q_width, shape.kv_width
        own = c * q + c * (q + 2 * k) + c * q + 4 * shape.num_heads  # o_proj input; q, k, v; output; lse
        if shape.qk_norm:
            own += _norm(q + k, shape.num_heads + shape.num_kv_heads, c, lean)
        if shape.attn_output_gate:
            own += 2 * c * q
        return own
    if kind != LINEAR:
        raise ValueError(f"unknown layer kind {kind!r}")
    nv, dk, dv = shape.linear_num_value_heads, shape.linear_key_head_dim, shape.linear_value_head_dim
    big_k, big_v, conv = nv * dk, nv * dv, shape.linear_conv_dim
    if linear_kernel == "fla":
        return c * (2 * big_k + big_v) + 4 * nv * CHUNK + 2 * c * big_v + c * conv + c * big_v
    if linear_kernel == "torch":
        return (4 * (8 * big_k + 7 * big_v) + 4 * 5 * nv * CHUNK + 4 * nv * dk * dv / CHUNK
                + 14 * big_v + 2 * c * conv + c * big_v)
    raise ValueError(f"linear attention kernel {linear_kernel!r} is not one of fla, torch")


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


@dataclass(frozen=True)
class LayerParts:
    """Saved bytes per token of one decoder layer by what each recompute policy replays (module
    doc, "By policy"); ``whole``: the replay of a whole checkpointed layer (the count)."""

    common: float
    mixer: float
    gate_up: float
    tail: float
    whole: float

    def kept(self, policy: str, lean_tails: bool) -> float:
        """Bytes a token a layer under ``policy`` keeps for its backward (``layer``: nothing
        here, its input being counted with the checkpointed layers' inputs). ``lean_tails``: lean
        activations with gradient checkpointing on, where ``ActorCritic`` gives the layers whose
        MLP is kept (``none``, ``mixer``) the lean tail."""
        tail = 0.0 if lean_tails and policy in ("none", "mixer") else self.tail
        if policy == "layer":
            return 0.0
        if policy == "mixer":
            return self.common + self.gate_up + tail
        if policy == "mlp":
            return self.common + self.mixer
        if policy == "none":
            return self.common + self.mixer + self.gate_up + tail
        raise ValueError(f"unknown recompute policy {policy!r} (one of {', '.join(POLICIES)})")

    def replayed(self, policy: str) -> float:
        """Bytes a token the backward of a layer under ``policy`` holds at once for its replay."""
        if policy == "layer":
            return self.whole
        backward = MLP_BACKWARD * self.gate_up  # a kept MLP's backward: gate's and up's gradients, the product
        return max(backward, self.mixer) if policy == "mixer" else backward


def _norm(width: int, rows: int, c: int, lean: bool) -> int:
    return c * width + 4 * rows if lean else 4 * width


@lru_cache(maxsize=512)  # pure; model.checkpoint_layers=auto asks it for every layer of every plan it weighs
def layer_parts(shape: ModelShape, kind: str, *, c: int, rank: int, adapted: int, linear_kernel: str = "fla",
                lean: bool = True) -> LayerParts:
    """``kind``'s saved bytes per token by part (module doc, "By policy"), calibrated;
    ``lean``: ``model.lean_activations`` (bf16 norm inputs)."""
    h, i = shape.hidden_size, shape.intermediate_size
    common = 2 * _norm(h, 1, c, lean) + c * 2 * h + c * rank * adapted
    mixer = _mixer_bytes(shape, kind, c=c, linear_kernel=linear_kernel, lean=lean)
    key = FULL if kind == FULL else f"{LINEAR}:{linear_kernel}"
    factor = PART_CALIBRATION[key]
    whole = saved_bytes_per_token(shape, kind, c=c, rank=rank, adapted=adapted, linear_kernel=linear_kernel)
    return LayerParts(common=common * factor, mixer=mixer * factor, gate_up=2 * c * i * factor,
                      tail=2 * c * i * factor, whole=whole)
