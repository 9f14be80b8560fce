"""The accelerator ``fit`` trains on: Lightning's, except on GPUs beside an in-process engine.

Lightning's ``CUDAAccelerator.setup`` (run by ``strategy.setup``, after the ``setup`` hooks, so after
``RolloutDataModule.setup`` has started the in-process vLLM engine and captured its CUDA graphs)
and its ``teardown`` call ``_clear_cuda_memory``: ``torch._C._cuda_clearCublasWorkspaces()``, then
``torch.cuda.empty_cache()``. The first frees the cuBLAS workspaces PyTorch keeps per handle and
stream. vLLM's eager warm-up before its capture makes one for the capture stream in PyTorch's
default pool, and every captured GEMM that uses workspace keeps that raw address: once freed (and
then released by any ``empty_cache``, or handed to the trainer) a graph replay writes where
nothing, or the trainer, now is. That is the likely cause of the hybrid's fault under LoRA sync
with CUDA graphs (the bench README's ninth attempt: gone with ``empty_cache`` disabled; the
standalone orders, with no Lightning ``Trainer``, never faulted). Not yet shown on a card:
``rollout/engine_checks.py`` refuses that combination until a run with this accelerator passes
(``bench/fit_trace.py --lightning-clears-workspaces`` puts Lightning's setup back, to show the
difference in the same session).

``InProcessEngineCUDA`` is Lightning's CUDA accelerator with that clear left out: the cached
memory is still returned (``torch.cuda.empty_cache``), the cuBLAS workspaces are kept for the
process's life (tens of MiB). Runs without an in-process engine on the cards keep Lightning's.
"""

from __future__ import annotations

from typing import Any, Union

from lightning.pytorch.accelerators import CUDAAccelerator


class InProcessEngineCUDA(CUDAAccelerator):
    """Lightning's CUDA accelerator, less the freeing of cuBLAS's workspaces (module doc)."""

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
