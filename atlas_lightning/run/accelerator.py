"""The accelerator ``fit`` trains on: Lightning's, except on GPUs beside an in-process engine.

Lightning's ``CUDAAccelerator.setup`` (run by ``strategy.setup``, after the ``setup`` hooks, so after
``RolloutDataModule.setup`` has started the in-process vLLM engine and captured its CUDA graphs)
and its ``teardown`` call ``_clear_cuda_memory``: ``torch._C._cuda_clearCublasWorkspaces()``, then
``torch.cuda.empty_cache()``. The first frees the cuBLAS workspaces PyTorch keeps per handle and
stream. vLLM's eager warm-up before its capture makes one for the capture stream in PyTorch's
default pool, and every captured GEMM that uses workspace keeps that raw address: once freed (and
then released by any ``empty_cache``, or handed to the trainer) a graph replay writes where
nothing, or the trainer, now is. Shown on an H100 (the tenth attempt in ``bench/README.md``): the 16-layer
Qwen3.6-27B shape under LoRA sync with CUDA graphs trained two steps with this accelerator and
faulted (a CUDA illegal memory access at the first request after the first wake) with Lightning's
set-up put back, in the same session. The engine refuses to start beside an accelerator that
frees them (``rollout/engine_checks.py``), which it recognises by ``keeps_cublas_workspaces``.

``InProcessEngineCUDA`` is Lightning's CUDA accelerator with that clear left out: the cached
memory is still returned (``torch.cuda.empty_cache``), the cuBLAS workspaces are kept for the
process's life (tens of MiB). Runs without an in-process engine on the cards keep Lightning's.
"""

from __future__ import annotations

from typing import Any, Union

from lightning.pytorch.accelerators import CUDAAccelerator


class InProcessEngineCUDA(CUDAAccelerator):
    """Lightning's CUDA accelerator, less the freeing of cuBLAS's workspaces (module doc)."""

    #: What the in-process engine's start checks for (``rollout/engine_checks.py``).
    keeps_cublas_workspaces = True

    def setup(self, trainer: Any) -> None:
        import torch

        self.set_nvidia_flags(trainer.local_rank)
        torch.cuda.empty_cache()  # Lightning's release, the cuBLAS workspaces kept

    def teardown(self) -> None:
        import torch

        torch.cuda.empty_cache()


def build_accelerator(cfg: Any) -> Union[str, CUDAAccelerator]:
    """``cfg.trainer.accelerator``, or ``InProcessEngineCUDA`` where it trains on GPUs beside an
    in-process engine (``rollout.engine=vllm``)."""
    from atlas_lightning.run.environment import trains_on_gpu

    accelerator = str(cfg.trainer.accelerator)
    if trains_on_gpu(accelerator) and str(cfg.rollout.engine) == "vllm":
        return InProcessEngineCUDA()
    return accelerator
