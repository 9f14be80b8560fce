"""Gated DeltaNet over packed rows (``models/linear_attention.py``) equals transformers' layer run
one sequence at a time: outputs and LoRA gradients, both kernel paths.

The reference is transformers' own ``Qwen3_5GatedDeltaNet.forward`` on each sequence alone, with
its pure-torch conv and delta rule (unwrapped: where flash-linear-attention imports,
transformers would otherwise call fla's kernel and the reference would not be independent).
Lengths straddle the 64-token chunks (1, 63, 64, 65, ...), and value heads outnumber key heads
(grouped value attention, as in Qwen3.6-27B's 48 over 16).

* torch path: CPU, fp32, to rounding (1e-5).
* fla path: needs a CUDA device and flash-linear-attention, else skipped with the reason. bf16
  against the fp32 reference; the bound is transformers' own torch code run in bf16 on the same
  weights (the fla path must be no further from fp32 than that, plus a small margin).
"""

from __future__ import annotations

import copy
import inspect
from contextlib import contextmanager

import pytest
import torch

from atlas_lightning.models import attention
from atlas_lightning.models.adapter_switch import selected_adapter
from atlas_lightning.models.linear_attention import CU_SEQLENS_KWARG, install_packed_linear_attention
from atlas_lightning.models.linear_kernels import fla_problem
from atlas_lightning.models.packing import pack_sequences
from tests.model_builds import actor_critic

LORA = {"rank": 4, "alpha": 8, "target_modules": "all-linear"}


def _hybrid(hidden: int, key_heads: int, value_heads: int, head_dim: int, device, dtype, seed: int = 0):
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=97, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
        linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, layer_types=["linear_attention", "full_attention"],
        max_position_embeddings=8192)
    torch.manual_seed(seed)
    base = Qwen3_5ForCausalLM(config).to(device=device, dtype=torch.float32)
    with torch.no_grad():
        for module in base.modules():  # decays and gates away from their initial constants
            if hasattr(module, "A_log"):
                module.A_log.uniform_(-1.0, 1.0)
                module.dt_bias.uniform_(-1.0, 1.0)
    model = actor_critic(base, LORA, gradient_checkpointing=False, linear_attention_kernel="torch")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.1)
    return model.to(dtype)


@contextmanager
def _torch_reference(model):
    """transformers' modeling globals set to their pure-torch conv and delta rule while inside."""
    layer = next(m for m in model.modules() if type(m).__name__ == "Qwen3_5GatedDeltaNet")
    modeling = inspect.getmodule(type(layer))
    names = ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")
    saved = {name: getattr(modeling, name) for name in names}
    try:
        for name in names:
            setattr(modeling, name, inspect.unwrap(saved[name]))
        yield
    finally:
        for name, value in saved.items():
            setattr(modeling, name, value)


def _hidden_and_grads(model, sequences, weights, packed: bool):
    """Actor adapter: last hidden states of every token (packed order) and the LoRA gradients of
    ``sum(hidden * weights)``; ``packed`` runs one packed row, else each sequence alone."""
    model.zero_grad(set_to_none=True)
    decoder = model.hf_model.base_model
    with selected_adapter(model._tuner_layers, "actor"):
        if packed:
            batch = pack_sequences(sequences, [1] * len(sequences)).to(weights.device)
            kwargs = {attention.SEQ_LENS_KWARG: tuple(batch.seq_lens), CU_SEQLENS_KWARG: batch.cu_seqlens.long()}
            hidden = decoder(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False,
                             **kwargs).last_hidden_state[0]
        else:
            with _torch_reference(model):
                hidden = torch.cat([decoder(input_ids=s[None].to(weights.device), use_cache=False).last_hidden_state[0]
                                    for s in sequences])
    (hidden.float() * weights).sum().backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return hidden.detach().float(), grads


def _relative(a, b) -> float:
    return float((a - b).norm() / b.norm())


def _errors(got, reference) -> dict:
    (hidden, grads), (ref_hidden, ref_grads) = got, reference
    assert sorted(grads) == sorted(ref_grads) and len(grads) > 0
    return {"hidden": _relative(hidden, ref_hidden), "grads": max(_relative(grads[k], ref_grads[k]) for k in ref_grads)}


def _sequences(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (n,), generator=g) for n in lengths]


def test_torch_path_equals_per_sequence_reference():
    model = _hybrid(64, 2, 6, 16, "cpu", torch.float32)
    assert model.linear_attention_kernel == "torch" and model.sequence_layout == "packed"
    sequences = _sequences((5, 63, 64, 65, 1, 130))
    weights = torch.randn(sum(s.numel() for s in sequences), 64, generator=torch.Generator().manual_seed(2))
    reference = _hidden_and_grads(model, sequences, weights, packed=False)
    errors = _errors(_hidden_and_grads(model, sequences, weights, packed=True), reference)
    assert errors["hidden"] < 1e-5 and errors["grads"] < 1e-5, errors


@pytest.mark.skipif(not torch.cuda.is_available() or fla_problem() is not None,
                    reason=f"needs a CUDA device and flash-linear-attention: "
                           f"{'no CUDA device' if not torch.cuda.is_available() else fla_problem()}")
def test_fla_path_equals_per_sequence_reference_within_bf16_rounding():
    # the 27B's linear-attention heads (16 key, 48 value heads of 128): the same tuned kernels
    reference_model = _hybrid(256, 16, 48, 128, "cuda", torch.float32)
    bf16 = copy.deepcopy(reference_model).to(torch.bfloat16)
    sequences = _sequences((1, 63, 64, 65, 300, 1000, 2047))
    weights = torch.randn(sum(s.numel() for s in sequences), 256, generator=torch.Generator().manual_seed(2)).cuda()
    reference = _hidden_and_grads(reference_model, sequences, weights, packed=False)
    torch_bf16 = _errors(_hidden_and_grads(bf16, sequences, weights, packed=True), reference)
    install_packed_linear_attention(bf16.decoder_layers(), "fla")
    fla_bf16 = _errors(_hidden_and_grads(bf16, sequences, weights, packed=True), reference)
    print(f"relative error against fp32, bf16 torch path {torch_bf16}, bf16 fla path {fla_bf16}")
    for key in ("hidden", "grads"):
        assert fla_bf16[key] <= 2 * torch_bf16[key] + 2e-3, (key, fla_bf16, torch_bf16)
    assert fla_bf16["hidden"] < 2e-2, fla_bf16
