"""Useful FLOPs: the arithmetic a pass must do on the real (non-padding) tokens, no more.

Definitions (per pass over sequences of lengths ``s_i``, ``T = sum s_i`` tokens, ``N`` of them
scored response tokens; ``W = sum in*out`` over the decoder's linear layers, ``L = sum r*(in+out)``
over the LoRA-wrapped ones for ONE adapter; ``H`` hidden, ``V`` vocabulary):

* forward:   ``2*W*T + 2*L*T + A + head``
  - ``A = sum over full-attention layers, over sequences, of 2 * s_i^2 * heads * head_dim``
    (QK^T and PV, causal: half of the square);
  - ``head``: actor ``2*H*V*N`` (the lm_head on scored positions only), critic ``2*H*N``.
* backward (frozen base: no weight gradients for it):
  ``2*W*T`` (input gradients through the base) ``+ 4*L*T`` (LoRA input and weight gradients)
  ``+ 2*A`` (dQ, dK, dV) ``+ head`` (input gradient of the head).
* not counted: recomputation (activation checkpointing, the chunked head's replay: they are
  costs of a memory strategy, not useful work), padding, norms, rotary, element-wise ops, the
  Gated DeltaNet recurrence and conv1d of the hybrid's linear-attention layers (under 1% of
  their layer's FLOPs at these shapes; their projections are in ``W``).

Useful MFU = useful FLOPs / time / (the bf16 matmul rate measured in the same run). The
baseline does the same useful work on the same sequences, so the MFU ratio is the speed ratio.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelFlops:
    linear_params: int  # W
    lora_params: int  # L (one adapter)
    hidden_size: int
    vocab_size: int
    full_attention_layers: int
    attention_width: int  # query heads x head_dim

    def attention(self, seq_lens) -> float:
        return float(sum(2.0 * s * s * self.attention_width for s in seq_lens) * self.full_attention_layers)

    def head(self, role: str, scored: int) -> float:
        return 2.0 * self.hidden_size * (self.vocab_size if role != "critic" else 1) * scored

    def forward(self, role: str, seq_lens, scored: int) -> float:
        t = sum(seq_lens)
        lora = self.lora_params if role != "base" else 0
        return 2.0 * (self.linear_params + lora) * t + self.attention(seq_lens) + self.head(role, scored)

    def backward(self, role: str, seq_lens, scored: int) -> float:
        t = sum(seq_lens)
        return 2.0 * self.linear_params * t + 4.0 * self.lora_params * t + 2.0 * self.attention(seq_lens) \
            + self.head(role, scored)

    def train_step(self, role: str, seq_lens, scored: int) -> float:
        return self.forward(role, seq_lens, scored) + self.backward(role, seq_lens, scored)


FORMULA = (
    "forward = 2*W*T + 2*L*T + A + head; backward = 2*W*T + 4*L*T + 2*A + head; "
    "W = sum(in*out) of decoder linears, L = sum(r*(in+out)) of one adapter's LoRA, T = real tokens, "
    "A = sum over full-attention layers and sequences of 2*s^2*heads*head_dim, "
    "head = 2*H*V*N (actor, N scored tokens) or 2*H*N (critic); recomputation, padding and the "
    "linear-attention recurrence not counted"
)


def model_flops(model, rank: int) -> ModelFlops:
    """``ModelFlops`` of a bare transformers causal LM (before LoRA), LoRA rank ``rank`` on every
    decoder linear (peft's all-linear)."""
    from .shapes import linear_shapes

    shapes = linear_shapes(model)
    config = model.config
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return ModelFlops(
        linear_params=sum(i * o for i, o in shapes),
        lora_params=sum(rank * (i + o) for i, o in shapes),
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        full_attention_layers=sum(1 for t in types[: config.num_hidden_layers] if t == "full_attention"),
        attention_width=config.num_attention_heads * config.head_dim,
    )
