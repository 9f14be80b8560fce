"""In-process vLLM engines end when closed, not when the garbage collector reaches them, and
closing one leaves the process's groups to whoever still uses them: another engine, the trainer.

Runs in a child process: its torch default group and vLLM's process-wide state are its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]  # several engines started and closed: make test-e2e

_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="2",
                      VLLM_LOGGING_LEVEL="ERROR", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    import torch, torch.distributed as dist
    from vllm import SamplingParams
    from vllm.distributed import parallel_state
    from atlas_lightning.rollout.engines.vllm_lifetime import shut_down_llm, start_llm

    kwargs = dict(model=sys.argv[1], enforce_eager=True, dtype="float32", max_model_len=256, seed=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 17, 42, 99, 7]}]
    tokens = lambda llm: list(llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids)

    dist.init_process_group("gloo", rank=0, world_size=1)  # the trainer's group, made first
    trainer_group = dist.group.WORLD
    first, second = start_llm(**kwargs), start_llm(**kwargs)
    reference = tokens(first)
    shut_down_llm(second)
    assert tokens(first) == reference, "closing one engine broke the other"
    shut_down_llm(first)
    shut_down_llm(first)  # a second close is a no-op
    assert parallel_state._WORLD is None, "vLLM's groups outlived the last engine"
    assert dist.is_initialized() and dist.group.WORLD is trainer_group, "the trainer's group was ended"
    ones = torch.ones(2)
    dist.all_reduce(ones)
    third = start_llm(**kwargs)  # a later engine starts on clean state
    assert tokens(third) == reference
    shut_down_llm(third)
    assert dist.is_initialized()
    dist.destroy_process_group()

    fourth = start_llm(**kwargs)  # no trainer group: the engine makes one, and ends it
    assert tokens(fourth) == reference
    shut_down_llm(fourth)
    assert not dist.is_initialized(), "the engine's own default group outlived it"
    print("LIFETIMES OK")
""")


def test_engines_end_when_closed_and_leave_the_groups_of_others(tiny_model_dir, tmp_path):
    from atlas_lightning.rollout.engines.server_http import free_port

    script = tmp_path / "lifetimes.py"
    script.write_text(_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tiny_model_dir), str(free_port())],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "LIFETIMES OK" in done.stdout, done.stderr[-4000:]
    assert "Invalid process group" not in done.stderr  # nothing left for vLLM's exit-time finalizer
