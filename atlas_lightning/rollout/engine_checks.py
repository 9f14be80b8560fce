"""What the in-process vLLM engine needs of the Lightning ``Trainer`` it runs in.

An engine with CUDA graphs (``rollout.enforce_eager=false``) in the trainer's process keeps, in
its captured GEMMs, the addresses of the cuBLAS workspaces its warm-up made. Lightning's
``CUDAAccelerator.setup`` (run after the ``setup`` hooks, so after ``RolloutDataModule.setup`` has
started the engine) and its ``teardown`` free every cuBLAS workspace
(``torch._C._cuda_clearCublasWorkspaces``); the next ``torch.cuda.empty_cache`` unmaps that
memory, or the trainer's tensors take it, and a graph replay then writes where nothing, or the
trainer, is. On the 16-layer Qwen3.6-27B shape under LoRA sync that was a CUDA illegal memory
access at the engine's first request after its first wake, which aborted the process (six tries
over two sessions); with the accelerator ``fit`` builds (``run/accelerator.InProcessEngineCUDA``,
which keeps the workspaces) the same run trained two steps, and with Lightning's set-up put back in
the same session it faulted again (the tenth attempt in ``bench/README.md``). A run that faults nowhere may
still have had its replays write into memory the trainer held: the dense 8B's merged sync never
faulted, which proves nothing.

So the engine refuses to start beside an accelerator that frees the workspaces: ``fit`` never
builds one, but a ``Trainer`` assembled by hand (``accelerator="gpu"``) would. ``InProcessEngineCUDA``
is recognised by what it declares (``keeps_cublas_workspaces``): the rollout room imports nothing
of ``run``.
"""

from __future__ import annotations

from typing import Any, Optional


def accelerator_refusal(cfg: Any, accelerator: Any) -> Optional[str]:
    """Why the in-process engine of ``cfg`` (a composed config) cannot start beside the trainer's
    ``accelerator`` (a Lightning accelerator; None: no trainer), or None where it can: only an
    engine in this process (``rollout.engine=vllm``) that captures CUDA graphs, beside a CUDA
    accelerator that frees cuBLAS's workspaces (module doc), is refused. A CPU accelerator's engine
    captures no graphs; a server engine (``vllm-server``) has its own process."""
    r = cfg.rollout
    if str(r.engine) != "vllm" or bool(r.enforce_eager) or accelerator is None:
        return None
    from lightning.pytorch.accelerators import CUDAAccelerator

    if not isinstance(accelerator, CUDAAccelerator) or getattr(accelerator, "keeps_cublas_workspaces", False):
        return None
    return (f"rollout.engine=vllm with CUDA graphs (rollout.enforce_eager=false) beside the trainer's "
            f"{type(accelerator).__name__}, whose set-up and teardown free cuBLAS's workspaces: the engine's "
            f"captured graphs keep their addresses, and a replay then writes into freed memory (a CUDA illegal "
            f"memory access that aborts the process, or silently into the trainer's tensors). Build the Trainer "
            f"with accelerator=atlas_lightning.run.accelerator.InProcessEngineCUDA() (as fit does), or set "
            f"rollout.enforce_eager=true")
