"""vLLM's CPU engine serves the tiny model and agrees with transformers (tokens and log-probs)."""

from __future__ import annotations

import os
import time

import pytest

# Read by vLLM and the CPU worker when they start: set before anything imports vllm.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.mark.vllm
def test_vllm_greedy_tokens_and_logprobs_match_transformers(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    from atlas_lightning.env.tools import tool_schemas
    from atlas_lightning.rollout.engines.vllm_lifetime import shut_down_llm, start_llm

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [
        {"role": "system", "content": "You are the orchestrator."},
        {"role": "user", "content": "A 2.0 kg block slides down a 3.5 m ramp. Speed?\nA) 8.28 m/s\nB) 68.6 m/s"},
    ]
    prompt = tokenizer.apply_chat_template(
        messages, tools=tool_schemas("gpqa"), add_generation_prompt=True, return_dict=False
    )

    started = time.perf_counter()
    llm = start_llm(model=str(tiny_model_dir), enforce_eager=True, dtype="float32", max_model_len=2048, seed=0)
    loaded = time.perf_counter()
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    sampled = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, logprobs=0, seed=1234)
    try:
        outputs = llm.generate([{"prompt_token_ids": prompt}] * 2, [greedy, sampled])
    finally:
        shut_down_llm(llm)
    greedy_out, sampled_out = (o.outputs[0] for o in outputs)
    generated = time.perf_counter()

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert list(greedy_out.token_ids) == reference[0, len(prompt):].tolist()
    assert len(set(greedy_out.token_ids)) > 2  # not a degenerate echo: the comparison means something

    for out in (greedy_out, sampled_out):
        tokens = list(out.token_ids)
        engine = torch.tensor([step[token].logprob for step, token in zip(out.logprobs, tokens)])
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        trainer = torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert torch.allclose(engine, trainer, atol=1e-4, rtol=0), (engine - trainer).abs().max()
    print(f"vLLM LLM() {loaded - started:.1f} s, two 24-token generations {generated - loaded:.1f} s")
