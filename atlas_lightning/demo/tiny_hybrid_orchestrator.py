"""``build_tiny_hybrid_orchestrator``: the tiny orchestrator's SFT warm start on a Qwen3.5-family base.

The same idea and recipe as the dense tiny orchestrator (``tiny_orchestrator.py``: scripted
tool-call episodes of the bundled sample, loss on generated tokens, ``SFTRecipe``), on a tiny
hybrid of Gated DeltaNet and attention layers written as Qwen3.5/3.6 checkpoints are, so that the
report's architecture can be shown to learn under PPO, not only run.

Base (``TINY_HYBRID_ARCHITECTURE``, ``build_tiny_hybrid_base``): ``Qwen3_5ForConditionalGeneration``
(``demo/tiny_causal_lm.py``), hidden 128, 4 decoder layers of which the 4th is full attention
(Qwen3.6-27B's 3:1 pattern), 4 query / 2 key-value heads of 32 as the dense tiny model, Gated
DeltaNet 1 key / 2 value heads of 128 (the head size of Qwen3.6-27B and the only one vLLM's CPU
kernel takes), MLP 384, untied head (as Qwen3.6-27B), a toy vision tower; the dense tiny model's
tokenizer (vocabulary 2,048) and chat template (``tiny_model.build_tiny_model``, same seed).

Training reads the text model alone (``AutoModelForCausalLM``: ``Qwen3_5ForCausalLM``, float32,
transformers' torch Gated DeltaNet on CPU); the result is written back in the base's checkpoint
format (``save_image_text``: the trained text weights under ``model.language_model.*``, the base's
vision tower unchanged), which the trainer and vLLM both read. Output: ``tiny_orchestrator``'s
layout and ``sft_summary.json``. On CPU, transformers' reference Gated DeltaNet makes a step slow
(10 steps took 394 s on two shared cores, against the dense build's 0.28 s a step): the full
recipe (800 steps) belongs on a card (``--device cuda``, flash-linear-attention's kernels).

Who calls it: tests (a few SFT steps); ``python -m atlas_lightning.demo.tiny_hybrid_orchestrator
--out DIR [--seed N] [--steps N]`` (the full recipe by default).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Optional

from atlas_lightning.demo.tiny_orchestrator import DEFAULT_RECIPE, SFTRecipe, build_tiny_orchestrator

#: ``save_tiny_causal_lm`` arguments of the hybrid base (module doc).
TINY_HYBRID_ARCHITECTURE = dict(
    arch="qwen3_5", hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, tie_word_embeddings=False, initializer_range=0.1,
    full_attention_every=4, linear_num_key_heads=1, linear_num_value_heads=2, linear_head_dim=128,
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_tiny_hybrid_base(folder: Path, seed: int = 0) -> Path:
    """The hybrid base of the module doc in ``folder`` (random weights from ``seed``, float32,
    with the dense tiny model's tokenizer files): ``tiny_orchestrator``'s base layout."""
    from atlas_lightning.demo.tiny_causal_lm import save_tiny_causal_lm
    from atlas_lightning.demo.tiny_model import build_tiny_model
    from atlas_lightning.demo.tiny_tokenizer import VOCAB_SIZE

    folder = Path(folder)
    save_tiny_causal_lm(folder, vocab_size=VOCAB_SIZE, seed=seed, **TINY_HYBRID_ARCHITECTURE)
    with tempfile.TemporaryDirectory(prefix=".tokenizer.", dir=folder.parent) as tmp:
        dense = Path(tmp) / "dense"
        build_tiny_model(dense, seed=seed)
        for name in _TOKENIZER_FILES:
            shutil.copyfile(dense / name, folder / name)
    return folder


def save_image_text(model, base_dir: Path, folder: Path) -> None:
    """Write the trained text model ``model`` (``Qwen3_5ForCausalLM``) into ``folder`` as the
    base's image-text checkpoint: the base read as ``Qwen3_5ForConditionalGeneration``, its text
    model and head replaced by the trained ones (every tensor: a strict load), its vision tower
    kept, saved with the base's config."""
    import torch
    from transformers import AutoModelForImageTextToText

    full = AutoModelForImageTextToText.from_pretrained(base_dir, dtype=next(model.parameters()).dtype)
    with torch.no_grad():
        full.model.language_model.load_state_dict(model.model.state_dict(), strict=True)
        full.lm_head.load_state_dict(model.lm_head.state_dict(), strict=True)
    full.save_pretrained(folder)


def build_tiny_hybrid_orchestrator(out: Path, seed: int = 0, *, recipe: SFTRecipe = DEFAULT_RECIPE,
                                   sample_seed: int = 0, device: str = "cpu") -> dict:
    """``tiny_orchestrator.build_tiny_orchestrator`` on the hybrid base (built from ``seed`` in a
    temporary folder beside ``out``), trained on ``device``, saved as an image-text checkpoint;
    returns its summary."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.base.", dir=out.parent) as tmp:
        base = build_tiny_hybrid_base(Path(tmp) / "base", seed)
        return build_tiny_orchestrator(out, seed, base, recipe=recipe, sample_seed=sample_seed,
                                       save_model=save_image_text, device=device)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m atlas_lightning.demo.tiny_hybrid_orchestrator",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the folder to write (replaced when it exists)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=DEFAULT_RECIPE.steps, help="SFT steps (the recipe's by default)")
    parser.add_argument("--device", default="cpu", help="where it trains: cpu, or cuda (with fla: minutes, not hours)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: must be >= 1")
    summary = build_tiny_hybrid_orchestrator(args.out, args.seed, recipe=replace(DEFAULT_RECIPE, steps=args.steps),
                                             device=args.device)
    print(json.dumps({k: summary[k] for k in ("out", "steps", "first_loss", "final_loss", "eval")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
