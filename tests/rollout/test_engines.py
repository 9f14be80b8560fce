"""vLLM (CPU build) against the transformers reference engine on the tiny model: greedy tokens
and log-probs agree, with and without a LoRA adapter; adapters are never served stale."""

from __future__ import annotations

import pytest
import torch

from atlas_lightning.rollout.engine import AdapterVersion, GenerationRequest, SamplingSpec
from atlas_lightning.rollout.engines.hf_engine import HFEngine
from atlas_lightning.rollout.digest import digest_named, lora_digest

pytestmark = pytest.mark.vllm

PROMPTS = [[5, 17, 42, 99, 7], [300, 12, 12, 8, 150, 64, 3], list(range(20, 60))]


def _greedy(engine, prompts, max_tokens=12, tag="g"):
    requests = [GenerationRequest(f"{tag}{i}", tuple(p), SamplingSpec(max_tokens=max_tokens, temperature=0.0))
                for i, p in enumerate(prompts)]
    return engine.generate(requests)


def _random_adapter(model_dir, folder, seed):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.2)
    model.save_pretrained(folder)
    modules = {name: (m.lora_A["default"].weight, m.lora_B["default"].weight, m.scaling["default"])
               for name, m in model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    # what a faithful vLLM worker holds: float32 factors, B scaled by alpha / r (exact, computed here)
    return lora_digest(modules, dtype=torch.float32, scale_b=True)


@pytest.fixture(scope="module")
def hf_engine(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return HFEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))


def _assert_same(vllm_results, hf_results, tol=2e-4):
    for v, h in zip(vllm_results, hf_results):
        assert v.token_ids == h.token_ids
        assert v.finish_reason == h.finish_reason
        assert max(abs(a - b) for a, b in zip(v.logprobs, h.logprobs)) < tol


def test_greedy_base_matches_reference(vllm_engine, hf_engine):
    vllm_engine.set_adapter(None)
    hf_engine.set_adapter(None)
    _assert_same(_greedy(vllm_engine, PROMPTS), _greedy(hf_engine, PROMPTS))
    probe = PROMPTS[2]
    gap = max(abs(a - b) for a, b in zip(vllm_engine.prompt_logprobs(probe), hf_engine.prompt_logprobs(probe)))
    assert gap < 2e-4


def test_greedy_with_lora_matches_reference_and_is_never_stale(vllm_engine, hf_engine, tiny_model_dir, tmp_path):
    expected_1 = _random_adapter(tiny_model_dir, tmp_path / "v1", seed=1)
    expected_2 = _random_adapter(tiny_model_dir, tmp_path / "v2", seed=2)
    base_out = _greedy(vllm_engine, PROMPTS, tag="b")

    report = vllm_engine.set_adapter(AdapterVersion(str(tmp_path / "v1"), version=1))
    assert report.tensor_count == len(expected_1) == 4 * 7 * 2  # A and B of 7 linears in 4 layers
    assert report.form == {"kind": "lora", "dtype": "float32", "scale_b": True}
    assert report.digest.entries == expected_1.entries  # read back from the worker, bit for bit
    hf_engine.set_adapter(AdapterVersion(str(tmp_path / "v1"), version=1))
    v1 = _greedy(vllm_engine, PROMPTS, tag="v1")
    _assert_same(v1, _greedy(hf_engine, PROMPTS, tag="h1"))
    assert [r.token_ids for r in v1] != [r.token_ids for r in base_out]

    report = vllm_engine.set_adapter(AdapterVersion(str(tmp_path / "v2"), version=2))
    assert report.digest.entries == expected_2.entries
    hf_engine.set_adapter(AdapterVersion(str(tmp_path / "v2"), version=2))
    v2 = _greedy(vllm_engine, PROMPTS, tag="v2")
    _assert_same(v2, _greedy(hf_engine, PROMPTS, tag="h2"))
    assert [r.logprobs for r in v2] != [r.logprobs for r in v1]
    vllm_engine.set_adapter(None)


def test_seeded_sampling_does_not_depend_on_batch_company(vllm_engine):
    def sample(prompts, tag):
        requests = [GenerationRequest(f"{tag}{i}", tuple(p), SamplingSpec(max_tokens=16, temperature=1.0, seed=1234))
                    for i, p in enumerate(prompts)]
        return vllm_engine.generate(requests)

    alone = sample([PROMPTS[0]], "alone")[0]
    crowded = sample([PROMPTS[1], PROMPTS[0], PROMPTS[2]], "crowd")[1]
    assert alone.token_ids == crowded.token_ids
    assert alone.logprobs == pytest.approx(crowded.logprobs, abs=1e-5)


def test_seeded_sampling_survives_prompts_beyond_one_step_budget(vllm_engine):
    """Twelve 1,500-token seeded prompts (18,000 tokens, over the 4,096 a step) at once: with
    chunked prefill, vLLM 0.32 on CPU failed the step ("CPU Generator does not use offset") and
    stranded every request; each must finish, as it does alone."""
    prompts = [[(7 * i + 3 * k) % 1900 + 10 for k in range(1500)] for i in range(12)]

    def requests(chosen, tag):
        return [GenerationRequest(f"{tag}{i}", tuple(prompts[i]), SamplingSpec(max_tokens=8, temperature=1.0, seed=99 + i))
                for i in chosen]

    crowd = vllm_engine.generate(requests(range(12), "long"))
    assert [r.finish_reason for r in crowd] == ["length"] * 12
    alone = vllm_engine.generate(requests([5], "long-alone"))[0]
    assert alone.token_ids == crowd[5].token_ids
    assert alone.logprobs == pytest.approx(crowd[5].logprobs, abs=1e-5)


def test_merged_weights_in_buckets_reach_the_in_process_engine(vllm_engine, hf_engine, tiny_model_dir, randomize):
    """The colocated merged sync (``rollout/sync.py``): ``merged_weight_buckets`` streamed
    into one reload, with bucket boundaries inside fused layers (loading bucket by bucket
    corrupted those layers); the engine then serves the merged model, and a fresh adapter
    (B = 0, so merged = base exactly) brings the base back for the tests after this one."""
    from transformers import AutoModelForCausalLM

    from tests.model_builds import actor_critic
    from atlas_lightning.models.weights import merged_weight_buckets, merged_weights

    vllm_engine.set_adapter(None)
    model = actor_critic(str(tiny_model_dir), {"rank": 8, "alpha": 16}, dtype="float32")
    base_tokens = [r.token_ids for r in _greedy(vllm_engine, PROMPTS, tag="mb")]
    try:
        randomize(model, seed=5, scale=0.2)
        merged = {name: t.clone() for name, t in merged_weights(model, "actor")}
        buckets = list(merged_weight_buckets(model, "actor", 64 * 1024))
        assert len(buckets) > 3 and any(  # a boundary inside a fused vLLM layer (q | k, gate | up)
            b[-1][0].endswith(("q_proj.weight", "gate_proj.weight")) for b in buckets)
        report = vllm_engine.load_weights(pair for bucket in buckets for pair in bucket)
        # the engine's report: what its loader consumed, tensor by tensor
        assert report.tensor_count == len(merged)
        assert report.digest.entries == digest_named(merged.items()).entries
        reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        assert not reference.load_state_dict(merged, strict=False).unexpected_keys
        served = _greedy(vllm_engine, PROMPTS, tag="m")
        _assert_same(served, _greedy(HFEngine(reference), PROMPTS, tag="mr"))
        assert [r.token_ids for r in served] != base_tokens
    finally:
        fresh = actor_critic(str(tiny_model_dir), {"rank": 8, "alpha": 16}, dtype="float32")
        vllm_engine.load_weights(iter(merged_weights(fresh, "actor")))
    assert [r.token_ids for r in _greedy(vllm_engine, PROMPTS, tag="mb2")] == base_tokens
