"""``bench/fit_trace.py``: an exception out of vLLM's model runner is printed with its frames before
it travels on (a CUDA fault there aborts the process and loses them), and each switch does what
the bench README's ninth attempt says it did. In a fresh process: the tool patches globally."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.vllm

SCRIPT = textwrap.dedent("""
    import torch
    import vllm.v1.worker.gpu_model_runner as runner
    from atlas_lightning.bench.fit_trace import install
    from atlas_lightning.rollout import sync

    install(no_empty_cache=True, skip_base_probe=True, lightning_clears_workspaces=True)
    try:
        runner.GPUModelRunner.execute_model(object(), None)
    except Exception as err:
        print("travelled on:", type(err).__name__)
    print("empty_cache:", torch.cuda.empty_cache())
    print("base reading:", sync.WeightSync._base_reading(None, None, [1], None, 0, "cpu"))

    from atlas_lightning.bench.fit_trace import _without_release
    released = []
    torch.cuda.empty_cache = lambda: released.append(1)
    _without_release(lambda: torch.cuda.empty_cache())()
    torch.cuda.empty_cache()
    print("released outside the wake only:", released == [1])

    from lightning.pytorch.accelerators import CUDAAccelerator
    from atlas_lightning.run.accelerator import InProcessEngineCUDA
    print("lightning's setup back:", InProcessEngineCUDA.setup is CUDAAccelerator.setup)
    print("still passes the engine's start:", InProcessEngineCUDA.keeps_cublas_workspaces)
""")


def test_the_runner_error_is_printed_with_its_frames_and_the_switches_apply():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "[fit_trace] vllm.v1.worker.gpu_model_runner.GPUModelRunner.execute_model raised:" in done.stdout
    assert "Traceback (most recent call last)" in done.stderr and "gpu_model_runner.py" in done.stderr
    assert "travelled on:" in done.stdout
    assert "empty_cache: None" in done.stdout and "base reading: None" in done.stdout
    assert "released outside the wake only: True" in done.stdout
    assert "lightning's setup back: True" in done.stdout
    assert "still passes the engine's start: True" in done.stdout  # so the fault can be reproduced
