"""The tiny hybrid orchestrator's builder (``demo/tiny_hybrid_orchestrator.py``): the dense tiny
orchestrator's SFT on a Qwen3.5-family base, a few steps only (the full recipe is a card's job).
The result is the image-text checkpoint format, with the trained text weights and the base's
vision tower, and the trainer's loader reads every base tensor of it."""

from __future__ import annotations

import json
import math

import torch

from atlas_lightning.demo.tiny_hybrid_orchestrator import build_tiny_hybrid_base, build_tiny_hybrid_orchestrator
from atlas_lightning.demo.tiny_orchestrator import SFTRecipe

FEW_STEPS = SFTRecipe(demos_per_question=1, train_questions=2, steps=3, batch_size=2, warmup_steps=1,
                      eval_questions=0, val_loss_questions=1)


def test_a_few_sft_steps_on_the_hybrid_base(tmp_path):
    from safetensors.torch import load_file

    from atlas_lightning.models.build import check_base_weights

    base = build_tiny_hybrid_base(tmp_path / "base", seed=0)
    out = tmp_path / "tiny-hybrid-orchestrator"
    summary = build_tiny_hybrid_orchestrator(out, seed=0, recipe=FEW_STEPS)

    assert summary["steps"] == 3 and all(math.isfinite(v) for v in summary["loss_every_10_steps"])
    assert math.isfinite(summary["eval"]["val_demo_loss"])
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    text = config["text_config"]
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert (text["linear_key_head_dim"], text["vocab_size"]) == (128, 2048)
    assert (out / "chat_template.jinja").read_bytes() == (base / "chat_template.jinja").read_bytes()

    before, after = load_file(str(base / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(before) == set(after)
    visual = [k for k in after if k.startswith("model.visual.")]
    assert visual and all(torch.equal(before[k], after[k]) for k in visual)  # the tower is the base's
    trained = [k for k in after if k.startswith("model.language_model.layers.") and not torch.equal(before[k], after[k])]
    assert any(".linear_attn." in k for k in trained) and any(".self_attn." in k for k in trained)
    check_base_weights(out)
