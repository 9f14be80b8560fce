"""``build_tiny_model``: a tiny random Qwen3 model and its tokenizer, built locally, no download.

The embedded default (``conf/model/tiny.yaml``) trains and serves it on CPU: a forward and
backward pass over 8 sequences of 1,536 tokens takes about 7 s on two shared cores (32 sequences:
about 20 s, attention dominating), and it is large enough to learn the tool-call format by SFT.
vLLM's CPU backend serves it (head_dim 32 is one of its supported sizes).

Architecture (``TINY_ARCHITECTURE``): ``Qwen3ForCausalLM``, hidden 128, 4 layers, 4 query heads
and 2 key/value heads of head_dim 32, MLP 384, tied embeddings, 4,096 positions, vocabulary 2,048
(``tiny_tokenizer.VOCAB_SIZE``), eos ``<|im_end|>``, pad ``<|endoftext|>``, float32 weights,
about 1.05M parameters. Weights are drawn with std 0.1 (about 1/sqrt(hidden)) rather than
Qwen's 0.02: at 0.02 and this width the tied embedding dominates the residual stream and the
random model greedily repeats its last token, which makes engine-agreement checks vacuous.

Output (Hugging Face layout): ``config.json``, ``generation_config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json`` (with ``chat_template``) and
``chat_template.jinja`` (transformers 5's own place for it; both hold the same template, so
older and newer loaders agree). Byte-identical for the same seed and library versions.

Who calls it: the CLI (``atlas-lightning data tiny-model --out DIR``), tests.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from atlas_lightning.demo.tiny_tokenizer import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    PAD_TOKEN,
    VOCAB_SIZE,
    to_transformers,
    train_tokenizer,
)
from atlas_lightning.store.files import sha256_file

TINY_ARCHITECTURE = {
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 384,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "initializer_range": 0.1,
}
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


def tiny_config(eos_token_id: int, pad_token_id: int):
    """The ``Qwen3Config`` of the tiny model (vocabulary ``VOCAB_SIZE``)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        dtype="float32",
        **TINY_ARCHITECTURE,
    )


def _add_template_to_config(folder: Path) -> None:
    """Put the chat template in tokenizer_config.json too (transformers 5 writes only the .jinja)."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
    jinja = folder / "chat_template.jinja"
    if not jinja.exists():
        jinja.write_text(CHAT_TEMPLATE, encoding="utf-8")


def build_tiny_model(out: Path, seed: int = 0) -> dict:
    """Build the tokenizer and the randomly initialised model, and save both under ``out``.

    The files are made in a temporary folder beside ``out`` and each moved into place with
    ``os.replace``; other files under ``out`` are left alone. The global torch RNG is untouched.
    Returns ``{"out", "seed", "vocab_size", "parameters", "architecture", "files": {name: sha256}}``.
    """
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM
    from transformers.utils import logging as hf_logging

    out = Path(out)
    tokenizer = train_tokenizer(seed)
    eos_id, pad_id = tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(PAD_TOKEN)
    config = tiny_config(eos_id, pad_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=[eos_id, pad_id], pad_token_id=pad_id)
    parameters = sum(p.numel() for p in model.parameters())

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a one-shard "Writing model shards" bar is noise in the CLI
    try:
        model.save_pretrained(staging)
        to_transformers(tokenizer, model_max_length=config.max_position_embeddings).save_pretrained(staging)
        _add_template_to_config(staging)
        for path in staging.iterdir():
            path.chmod(0o644)  # safetensors' temp file would leave the weights owner-only
        made = sorted(p.name for p in staging.iterdir())
        if made != sorted(MODEL_FILES):
            raise RuntimeError(f"tiny model build wrote {made}, expected {sorted(MODEL_FILES)}")
        out.mkdir(parents=True, exist_ok=True)
        for name in MODEL_FILES:
            os.replace(staging / name, out / name)
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()
        shutil.rmtree(staging, ignore_errors=True)
    return {
        "out": str(out),
        "seed": seed,
        "vocab_size": VOCAB_SIZE,
        "parameters": parameters,
        "architecture": dict(TINY_ARCHITECTURE),
        "files": {name: sha256_file(out / name) for name in MODEL_FILES},
    }
