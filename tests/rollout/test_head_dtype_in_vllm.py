"""``model.head_dtype=float32`` acts in the engine, not only in its config: on a bf16 model whose
logits reach 20-40 (as a trained model's top tokens do), the engine's log-probs follow the
trainer's float32 head and part from its rounded (bf16) head. An engine that ignored the override
would follow the rounded head instead."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.vllm

LORA = {"rank": 8, "alpha": 16}


@pytest.fixture(scope="module")
def large_logit_folder(tmp_path_factory):
    """A tiny Qwen3 folder in bf16 whose untied lm_head gives logits of 20-40, its layers adding
    nothing to the residual stream: the engine and the trainer then differ in the head alone
    (their layers' kernels would otherwise part the hidden states by bf16 rounding, which a head
    this large magnifies)."""
    from safetensors.torch import load_file, save_file

    from atlas_lightning.demo.tiny_causal_lm import save_tiny_causal_lm

    folder = save_tiny_causal_lm(tmp_path_factory.mktemp("large-logits"), arch="qwen3", seed=3)
    weights = folder / "model.safetensors"
    tensors = load_file(weights)
    head = tensors["lm_head.weight"]
    generator = torch.Generator().manual_seed(3)
    tensors["lm_head.weight"] = torch.randn(head.shape, generator=generator) * (12.0 / head.shape[1] ** 0.5)
    for name in tensors:  # layers that add nothing: both sides then hand the head the same hidden states
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros_like(tensors[name])
    save_file({name: t.bfloat16().contiguous() for name, t in tensors.items()}, weights, metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _trainer_scores(folder, sequences, prompt_length, head_dtype):
    from atlas_lightning.models.packing import pack_sequences
    from tests.model_builds import actor_critic

    model = actor_critic(str(folder), LORA, dtype="bfloat16", head_dtype=head_dtype)
    packed = pack_sequences([torch.tensor(s) for s in sequences], [prompt_length] * len(sequences))
    with torch.no_grad():
        log_probs, _ = model.actor_forward(packed, temperature=1.0, compute_entropy=False)
    return log_probs.double()


def _served(folder, sequences, engine_args, head_dtype):
    from atlas_lightning.rollout.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(engine_args(model=str(folder), dtype="bfloat16", lora_rank=None, head_dtype=head_dtype))
    try:
        return torch.tensor([lp for s in sequences for lp in engine.prompt_logprobs(s)], dtype=torch.float64)
    finally:
        engine.close()


def test_each_engine_head_follows_the_trainers_head_of_the_same_key(large_logit_folder, tiny_engine_args):
    """float32 on both sides agree (the engine applied the override), as do the rounded heads on
    both sides (the default, verl's numerics); across keys they part by the head's rounding."""
    pytest.importorskip("vllm")
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(10, 128, (48,), generator=generator).tolist() for _ in range(4)]
    exact = _trainer_scores(large_logit_folder, sequences, 1, "float32")
    rounded = _trainer_scores(large_logit_folder, sequences, 1, "model")
    assert (exact - rounded).abs().mean() > 2e-2  # the two heads part by more than the bounds below
    for head_dtype, same, other in (("float32", exact, rounded), ("model", rounded, exact)):
        served = _served(large_logit_folder, sequences, tiny_engine_args, head_dtype)
        assert (served - same).abs().mean() < 2e-3, head_dtype
        assert (served - other).abs().mean() > 2e-2, head_dtype
