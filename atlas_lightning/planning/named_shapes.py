"""Architectures by name, so that a run can be planned before its weights are fetched
(``model.shape``) and the benchmarks build the same shapes with random weights: the
transformers ``config.json`` fields of each (text decoder only).

* ``dense8b``: the Qwen3-8B shape (hidden 4096, 36 layers, 32 query / 8 KV heads of 128, MLP
  12288, vocabulary 151,936).
* ``qwen3_6_27b``: the Qwen3.6-27B text shape (``qwen3_5``: hidden 5120, 64 layers, three Gated
  DeltaNet linear-attention layers to one full-attention layer, 24 query / 4 KV heads of 256
  with an output gate, linear attention 16 key / 48 value heads of 128, MLP 17408, vocabulary
  248,320): the base of the training of record.
* ``tiny`` / ``tiny_hybrid``: the same two architectures at toy size (CPU smoke runs).
"""

from __future__ import annotations

from typing import Any

#: name -> (transformers model_type, the config fields of that shape)
NAMED_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "dense8b": ("qwen3", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, tie_word_embeddings=False,
    )),
    "qwen3_6_27b": ("qwen3_5", dict(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        max_position_embeddings=262144, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        # as the published checkpoints' config.json has it: vLLM then keeps the Gated DeltaNet
        # state in float32 between steps (rollout/engines/args.py)
        mamba_ssm_dtype="float32",
    )),
    "tiny": ("qwen3", dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=8192, tie_word_embeddings=False,
    )),
    "tiny_hybrid": ("qwen3_5", dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=8192, tie_word_embeddings=False,
    )),
}


def named_config(name: str) -> dict[str, Any]:
    """The ``config.json`` fields of shape ``name`` (with its ``model_type``); ``ValueError``
    naming the known ones otherwise."""
    if name not in NAMED_CONFIGS:
        raise ValueError(f"model.shape={name!r} is not a known shape ({', '.join(NAMED_CONFIGS)})")
    model_type, fields = NAMED_CONFIGS[name]
    return {"model_type": model_type, **fields}
