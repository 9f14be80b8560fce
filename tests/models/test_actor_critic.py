"""ActorCritic on one base: packed passes equal per-sequence forwards, adapters isolated,
gradient checkpointing keeps each replay on its own adapter."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from atlas_lightning.config import LoraConfig
from atlas_lightning.models.actor_critic import peft_lora_config
from atlas_lightning.models.packing import pack_sequences
from tests.model_builds import actor_critic

LORA = LoraConfig(rank=4, alpha=8, dropout=0.0, target_modules="all-linear")
LENGTHS, PROMPTS = (9, 4, 13, 6), (3, 2, 5, 1)


def _batch(vocab=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in LENGTHS]


def _model(base, randomize, **kwargs):
    model = actor_critic(base, LORA, logprob_chunk_tokens=5, **kwargs)
    randomize(model)
    return model


def _per_sequence_reference(model, sequences, temperature, attn_implementation=None):
    """Independent of packing, chunking and the adapter switch: each sequence alone through a
    copy of the peft model, adapters chosen with peft's own API, full logits; its attention
    ``attn_implementation`` (default: the model's own)."""
    peft_model = copy.deepcopy(model.peft_model)
    hf = peft_model.base_model.model
    if attn_implementation is not None:
        hf.set_attn_implementation(attn_implementation)
    out = {"actor": [], "entropy": [], "values": [], "base": []}
    for seq, prompt in zip(sequences, PROMPTS):
        ids = seq[None]
        targets = seq[prompt:]
        with torch.no_grad():
            peft_model.set_adapter("actor")
            logits = hf(input_ids=ids).logits[0, prompt - 1 : -1].float() / temperature
            out["actor"].append(torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0])
            out["entropy"].append(torch.distributions.Categorical(logits=logits).entropy())
            peft_model.set_adapter("critic")
            hidden = hf(input_ids=ids, output_hidden_states=True).hidden_states[-1][0, prompt - 1 : -1]
            out["values"].append(model.value_head(hidden.float())[:, 0])
            with peft_model.disable_adapter():
                logits = hf(input_ids=ids).logits[0, prompt - 1 : -1].float() / temperature
            out["base"].append(torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0])
    return {k: torch.cat(v) for k, v in out.items()}


@pytest.mark.parametrize("base_name", ["qwen3_base", "qwen3_tied_base", "qwen3_5_base"])
def test_packed_passes_equal_per_sequence_forwards(base_name, request, randomize):
    base = request.getfixturevalue(base_name)
    model = _model(base, randomize)
    sequences = _batch()
    packed = pack_sequences(sequences, PROMPTS)
    with torch.no_grad():
        log_probs, entropy = model.actor_forward(packed, temperature=0.7)
        values = model.critic_forward(packed)
    base_log_probs = model.base_forward(packed, temperature=0.7)
    expected = _per_sequence_reference(model, sequences, 0.7)
    assert log_probs.shape == (sum(LENGTHS) - sum(PROMPTS),)
    torch.testing.assert_close(log_probs, expected["actor"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, expected["entropy"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values, expected["values"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(base_log_probs, expected["base"], rtol=1e-5, atol=1e-5)
    # the adapters are non-trivial, so the comparisons above distinguish the three passes
    assert (log_probs - base_log_probs).abs().max() > 1e-2
    # verl layout: row i holds sequence i's response tokens, right-padded
    padded = packed.scatter_responses(log_probs)
    assert padded.shape == (4, max(n - p for n, p in zip(LENGTHS, PROMPTS)))
    torch.testing.assert_close(padded[1, : LENGTHS[1] - PROMPTS[1]], expected["actor"][6:8])


def test_base_pass_is_the_plain_base_model(qwen3_base, randomize):
    model = _model(qwen3_base, randomize)
    plain = AutoModelForCausalLM.from_pretrained(qwen3_base, dtype=torch.float32)
    sequences = _batch(seed=3)
    packed = pack_sequences(sequences, PROMPTS)
    got = model.base_forward(packed)
    assert not got.requires_grad
    expected = []
    with torch.no_grad():
        for seq, prompt in zip(sequences, PROMPTS):
            logits = plain(input_ids=seq[None]).logits[0, prompt - 1 : -1]
            expected.append(torch.log_softmax(logits, -1).gather(-1, seq[prompt:, None])[:, 0])
    torch.testing.assert_close(got, torch.cat(expected), rtol=1e-5, atol=1e-5)


def test_layout_choice(qwen3_base, qwen3_5_base):
    dense, hybrid = actor_critic(qwen3_base, LORA), actor_critic(qwen3_5_base, LORA)
    assert dense.sequence_layout == hybrid.sequence_layout == "packed"
    assert dense.linear_attention_kernel is None
    assert hybrid.linear_attention_kernel == "torch"  # no flash-linear-attention kernels on a CPU model
    assert actor_critic(qwen3_5_base, LORA, sequence_layout="padded").sequence_layout == "padded"
    with pytest.raises(ValueError, match="model.linear_attention_kernel=fla cannot run here"):
        actor_critic(qwen3_5_base, LORA, linear_attention_kernel="fla")


def test_transformers_still_leaks_across_packed_boundaries_in_linear_attention(qwen3_5_base):
    """Why ``linear_attention.py`` exists: transformers' own Gated DeltaNet carries conv and
    recurrent state across packed boundaries. If this starts failing, its layer learned them."""
    plain = AutoModelForCausalLM.from_pretrained(qwen3_5_base, dtype=torch.float32)
    sequences = _batch()
    packed = pack_sequences(sequences, PROMPTS)
    with torch.no_grad():
        together = plain(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False).logits[0]
        alone = torch.cat([plain(input_ids=s[None], use_cache=False).logits[0] for s in sequences])
    assert (together - alone).abs().max() > 1e-3


def test_each_loss_reaches_only_its_own_adapter(qwen3_base, randomize):
    model = _model(qwen3_base, randomize)
    actor, critic = model.actor_parameters(), model.critic_parameters()
    assert {id(p) for p in actor}.isdisjoint({id(p) for p in critic})
    assert all(p.requires_grad for p in actor + critic)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in actor + critic}  # the base is frozen
    packed = pack_sequences(_batch(), PROMPTS)

    log_probs, _ = model.actor_forward(packed)
    log_probs.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in actor)
    assert all(p.grad is None for p in critic)
    assert all(p.requires_grad for p in actor + critic)  # selection never flips requires_grad

    for p in actor:
        p.grad = None
    model.critic_forward(packed).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in critic)
    assert all(p.grad is None for p in actor)


def _grads(model, packed):
    """Interleaved passes before a single backward: the case where a checkpoint replay would
    run under whichever adapter happens to be selected at backward time."""
    log_probs, entropy = model.actor_forward(packed)
    values = model.critic_forward(packed)
    loss = (log_probs * torch.linspace(1, 2, log_probs.numel())).sum() + entropy.sum() + (values**2).sum()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("base_name, dropout", [("qwen3_base", 0.0), ("qwen3_5_base", 0.0), ("qwen3_base", 0.3)])
def test_gradient_checkpointing_gives_the_same_gradients(base_name, dropout, request, randomize):
    base = request.getfixturevalue(base_name)
    packed = pack_sequences(_batch(), PROMPTS)
    lora = {"rank": 4, "alpha": 8, "dropout": dropout}
    plain_model = actor_critic(base, lora, logprob_chunk_tokens=5)
    randomize(plain_model)
    torch.manual_seed(11)  # same dropout masks: the replay restores the RNG state of the forward
    plain = _grads(plain_model, packed)
    checkpointed_model = actor_critic(base, lora, logprob_chunk_tokens=5, gradient_checkpointing=True)
    randomize(checkpointed_model)
    assert all(layer.gradient_checkpointing for layer in checkpointed_model.decoder_layers())
    torch.manual_seed(11)
    checkpointed = _grads(checkpointed_model, packed)
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)


def test_from_config_builds_and_starts_adapters(qwen3_base, randomize, tmp_path):
    from atlas_lightning.config import ModelConfig
    from atlas_lightning.models.adapters import save_adapter
    from atlas_lightning.models.build import build_actor_critic

    trained = _model(qwen3_base, randomize)
    save_adapter(trained, "actor", tmp_path / "actor")
    cfg = ModelConfig(path=qwen3_base, dtype="float32", lora=LORA, gradient_checkpointing=True,
                      logprob_chunk_tokens=64, actor_adapter=str(tmp_path / "actor"))
    model = build_actor_critic(cfg)
    assert model.logprob_chunk_tokens == 64 and model.decoder_layers()[0].gradient_checkpointing
    for p, q in zip(trained.actor_parameters(), model.actor_parameters()):
        assert torch.equal(p, q)
    assert not torch.equal(trained.critic_parameters()[1], model.critic_parameters()[1])  # critic stays fresh


def test_init_is_deterministic_and_lora_spec_is_read(qwen3_base):
    a, b = actor_critic(qwen3_base, LORA, init_seed=7), actor_critic(qwen3_base, LORA, init_seed=7)
    for p, q in zip(a.actor_parameters() + a.critic_parameters(), b.actor_parameters() + b.critic_parameters()):
        assert torch.equal(p, q)
    config = a.peft_model.peft_config["critic"]
    assert (config.r, config.lora_alpha, config.task_type) == (4, 8, "CAUSAL_LM")
    assert not any("lm_head" in name for name in config.target_modules)  # peft's all-linear skips the head
    assert a.value_head.weight.dtype == torch.float32


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"rank": 0, "alpha": 8}, "rank=0"),
        ({"rank": 4, "alpha": -1}, "alpha=-1"),
        ({"rank": 4, "alpha": 8, "dropout": 1.5}, "dropout=1.5"),
        ("r=4", "must be a mapping"),
    ],
)
def test_bad_lora_spec(spec, message):
    with pytest.raises(ValueError, match=message):
        peft_lora_config(spec)


def test_bad_arguments(qwen3_base, tmp_path):
    with pytest.raises(FileNotFoundError, match="never a hub id"):
        actor_critic(str(tmp_path / "Qwen" / "Qwen3-8B"), LORA)
    with pytest.raises(ValueError, match="dtype='fp8'"):
        actor_critic(qwen3_base, LORA, dtype="fp8")
    with pytest.raises(ValueError, match="logprob_chunk_tokens=0"):
        actor_critic(qwen3_base, LORA, logprob_chunk_tokens=0)
    model = actor_critic(qwen3_base, LORA)
    with pytest.raises(TypeError, match="expected a PackedBatch"):
        model.actor_forward(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="mode='ref'"):
        model(pack_sequences(_batch(), PROMPTS), mode="ref")


@pytest.mark.slow
def test_flex_attention_block_mask_path(qwen3_base, randomize):
    """The GPU-recommended path (BlockMask, no dense T x T mask) gives the same numbers as each
    sequence alone through sdpa. Slow on CPU: the block mask and the attention are compiled
    with torch.compile for each shape, so the reference runs sdpa (each of its four lengths
    would be another compile) and only the packed row compiles."""
    model = _model(qwen3_base, randomize, attn_implementation="flex_attention")
    sequences = _batch()
    with torch.no_grad():
        log_probs, _ = model.actor_forward(pack_sequences(sequences, PROMPTS), temperature=0.7)
    expected = _per_sequence_reference(model, sequences, 0.7, attn_implementation="sdpa")["actor"]
    assert model.peft_model.base_model.model.config._attn_implementation == "flex_attention"  # the copy's changed
    torch.testing.assert_close(log_probs, expected, rtol=1e-5, atol=1e-5)
