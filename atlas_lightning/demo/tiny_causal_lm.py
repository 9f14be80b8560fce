"""Tiny random causal LMs saved as Hugging Face folders, for tests and CPU smoke runs.

Nothing is downloaded: the model is built from a config and ``save_pretrained``. Two
architectures, the two this project meets:

* ``qwen3``: ``Qwen3ForCausalLM`` (attention only; the tiny-cpu default's kind);
* ``qwen3_5``: ``Qwen3_5ForConditionalGeneration`` with a tiny vision tower, saved the way
  Qwen3.5/3.6 checkpoints are (``model.language_model.*`` names, hybrid linear/full
  attention layers); ``AutoModelForCausalLM`` loads its text part.

Who calls it: tests of the models room (and anyone needing a local base to point at).
"""

from __future__ import annotations

from pathlib import Path

import torch


def save_tiny_causal_lm(
    folder: str | Path,
    *,
    arch: str = "qwen3",
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 1,
    head_dim: int = 32,
    vocab_size: int = 128,
    tie_word_embeddings: bool = False,
    initializer_range: float = 0.1,
    seed: int = 0,
    full_attention_every: int = 2,
    linear_num_key_heads: int = 2,
    linear_num_value_heads: int = 2,
    linear_head_dim: int = 16,
) -> Path:
    """Build a random model of ``arch`` (``qwen3`` or ``qwen3_5``), save it to ``folder`` in
    fp32 and return the folder. Same arguments and seed, same weights. ``initializer_range``
    is larger than real models' 0.02 so that logits are far from uniform and errors show.
    ``qwen3_5`` only: every ``full_attention_every``-th layer is full attention, the others
    Gated DeltaNet with ``linear_num_key_heads`` / ``linear_num_value_heads`` heads of
    ``linear_head_dim`` (vLLM's CPU kernel takes 128 only; Qwen3.6-27B: every 4th, 16 / 48 of 128)."""
    folder = Path(folder)
    text = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, head_dim=head_dim, max_position_embeddings=4096,
        initializer_range=initializer_range,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if arch == "qwen3":
            from transformers import Qwen3Config, Qwen3ForCausalLM

            model = Qwen3ForCausalLM(Qwen3Config(**text, tie_word_embeddings=tie_word_embeddings))
        elif arch == "qwen3_5":
            from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

            layer_types = ["linear_attention" if (i + 1) % full_attention_every else "full_attention"
                           for i in range(num_hidden_layers)]
            text.update(
                layer_types=layer_types, linear_num_key_heads=linear_num_key_heads,
                linear_num_value_heads=linear_num_value_heads, linear_key_head_dim=linear_head_dim,
                linear_value_head_dim=linear_head_dim,
            )
            vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden_size,
                          patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
            model = Qwen3_5ForConditionalGeneration(
                Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=tie_word_embeddings)
            )
        else:
            raise ValueError(f"arch={arch!r} is not one of qwen3, qwen3_5")
    model.save_pretrained(str(folder))
    return folder
