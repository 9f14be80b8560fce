"""``sdpa_varlen`` attention: packed rows equal per-sequence forwards, no mask is built."""

from __future__ import annotations

import torch

from atlas_lightning.models.attention import NAME, sdpa_varlen_attention_forward
from atlas_lightning.models.packing import pack_sequences
from tests.model_builds import actor_critic

LORA = {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}


def test_packed_varlen_equals_per_sequence_sdpa(qwen3_base, randomize):
    varlen = actor_critic(qwen3_base, LORA, attn_implementation=NAME, logprob_chunk_tokens=7)
    dense = actor_critic(qwen3_base, LORA, attn_implementation="sdpa", logprob_chunk_tokens=7)
    randomize(varlen)
    dense.load_state_dict(varlen.state_dict())
    assert varlen.varlen_attention and not dense.varlen_attention
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 128, (n,), generator=gen) for n in (11, 4, 17, 6)]
    prompts = [3, 1, 5, 2]
    packed = pack_sequences(seqs, prompts)
    lp, ent = varlen.actor_forward(packed)
    lp.sum().backward()
    singles = [dense.actor_forward(pack_sequences([s], [p]))[0] for s, p in zip(seqs, prompts)]
    torch.testing.assert_close(lp.detach(), torch.cat(singles).detach(), rtol=1e-5, atol=1e-5)
    assert all(p.grad is not None for p in varlen.actor_parameters())


def test_padded_rows_exact_for_real_tokens():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 9, 8, generator=gen) for h in (4, 2, 2))
    out, _ = sdpa_varlen_attention_forward(torch.nn.Module(), q, k, v, None, scaling=0.3)
    # row 1 has 5 real tokens: its first 5 outputs must not depend on the 4 padded ones
    alone, _ = sdpa_varlen_attention_forward(torch.nn.Module(), q[1:, :, :5], k[1:, :, :5], v[1:, :, :5], None, scaling=0.3)
    torch.testing.assert_close(out[1:, :5], alone)


def test_bad_lengths_are_refused():
    q = torch.zeros(1, 2, 6, 4)
    try:
        sdpa_varlen_attention_forward(torch.nn.Module(), q, q, q, None, atlas_seq_lens=(2, 3))
    except ValueError as err:
        assert "sums to 5 tokens" in str(err)
    else:
        raise AssertionError("a length mismatch must raise")


def test_hybrid_padded_layout_varlen_equals_sdpa(qwen3_5_base, randomize):
    varlen = actor_critic(qwen3_5_base, LORA, attn_implementation=NAME, logprob_chunk_tokens=7, sequence_layout="padded")
    dense = actor_critic(qwen3_5_base, LORA, attn_implementation="sdpa", logprob_chunk_tokens=7, sequence_layout="padded")
    randomize(varlen)
    dense.load_state_dict(varlen.state_dict())
    assert varlen.sequence_layout == "padded"
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 128, (n,), generator=gen) for n in (13, 5, 9)]
    packed = pack_sequences(seqs, [4, 2, 3])
    torch.testing.assert_close(varlen.critic_forward(packed), dense.critic_forward(packed), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(varlen.actor_forward(packed)[0], dense.actor_forward(packed)[0], rtol=1e-5, atol=1e-5)
