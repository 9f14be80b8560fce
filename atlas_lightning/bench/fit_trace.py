"""The step benchmark (``step.py``, which is ``fit``) with the engine's failing call traced, and
the switches that separated the hybrid's CUDA-graph fault under LoRA sync (bench README, "Ninth
attempt"; ``rollout/engine_checks.py``):

    python -m atlas_lightning.bench.fit_trace [--no-empty-cache | --no-wake-empty-cache] [--skip-base-probe] \
        [--lightning-clears-workspaces] -- STEP_ARGS

* every exception out of vLLM's ``GPUModelRunner.execute_model`` / ``sample_tokens`` is printed
  with its traceback before vLLM's own handling (a CUDA fault there aborts the process in a
  tensor's destructor, which loses the Python frames; ``run/exit_codes.exit_code`` prints every
  thread's frames at the abort);
* each weight-sync probe prints its length, largest token id and adapter;
* ``--no-empty-cache``: ``torch.cuda.empty_cache`` does nothing in the process (vLLM's own calls
  included): the fault went away, and the second wake ran out of memory;
* ``--no-wake-empty-cache``: only ``VLLMEngine.wake_up``'s release is left out (vLLM's own, at its
  sleep, is kept): not yet run;
* ``--skip-base-probe``: the starting check does not read the base before the first load, so the
  first request after the wake carries the adapter;
* ``--lightning-clears-workspaces``: Lightning's own CUDA set-up and teardown, which free cuBLAS's
  workspaces, in place of ``run/accelerator.InProcessEngineCUDA``'s (the engine's start does not
  see it, the class being the same): the cause, shown in the tenth attempt (the fault with it,
  two steps without).

A diagnostic, not a figure of the product: its timings are the step benchmark's, with these
switches off.
"""

from __future__ import annotations

import argparse
import functools
import sys
import traceback


def _traced(cls, name: str) -> None:
    original = getattr(cls, name, None)
    if original is None:
        return

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        except BaseException:
            print(f"[fit_trace] {cls.__module__}.{cls.__name__}.{name} raised:", flush=True)
            traceback.print_exc()
            sys.stderr.flush()
            raise

    setattr(cls, name, wrapper)


def _without_release(method):
    """``method`` with ``torch.cuda.empty_cache`` doing nothing while it runs."""
    import torch

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        release, torch.cuda.empty_cache = torch.cuda.empty_cache, lambda: None
        try:
            return method(*args, **kwargs)
        finally:
            torch.cuda.empty_cache = release

    return wrapper


def install(no_empty_cache: bool, skip_base_probe: bool, no_wake_empty_cache: bool = False,
            lightning_clears_workspaces: bool = False) -> None:
    """Wrap vLLM's model runners and the engine's probe, and apply the switches (module doc)."""
    import torch
    import vllm.v1.worker.gpu_model_runner as v1_runner

    from atlas_lightning.rollout import sync
    from atlas_lightning.rollout.engines import vllm_engine

    for name in ("execute_model", "sample_tokens"):
        _traced(v1_runner.GPUModelRunner, name)
    probe = vllm_engine.VLLMEngine.prompt_logprobs

    def told_probe(self, token_ids):
        print(f"[fit_trace] probe: {len(token_ids)} tokens, largest id {max(token_ids)}, adapter {self._lora}",
              flush=True)
        return probe(self, token_ids)

    vllm_engine.VLLMEngine.prompt_logprobs = told_probe
    if no_empty_cache:
        torch.cuda.empty_cache = lambda: None
    if no_wake_empty_cache:
        vllm_engine.VLLMEngine.wake_up = _without_release(vllm_engine.VLLMEngine.wake_up)
    if lightning_clears_workspaces:
        from lightning.pytorch.accelerators import CUDAAccelerator

        from atlas_lightning.run.accelerator import InProcessEngineCUDA

        InProcessEngineCUDA.setup, InProcessEngineCUDA.teardown = CUDAAccelerator.setup, CUDAAccelerator.teardown
    if skip_base_probe:
        sync.WeightSync._base_reading = lambda self, *args, **kwargs: None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m atlas_lightning.bench.fit_trace",
                                     description=__doc__.split("\n\n")[0])
    releases = parser.add_mutually_exclusive_group()
    releases.add_argument("--no-empty-cache", action="store_true")
    releases.add_argument("--no-wake-empty-cache", action="store_true")
    parser.add_argument("--skip-base-probe", action="store_true")
    parser.add_argument("--lightning-clears-workspaces", action="store_true")
    parser.add_argument("step_args", nargs=argparse.REMAINDER, help="step.py's arguments, after --")
    args = parser.parse_args(argv)
    install(args.no_empty_cache, args.skip_base_probe, args.no_wake_empty_cache, args.lightning_clears_workspaces)
    from atlas_lightning.bench.step import main as step_main

    step_args = args.step_args[1:] if args.step_args[:1] == ["--"] else args.step_args
    return step_main(step_args)


if __name__ == "__main__":
    sys.exit(main())
