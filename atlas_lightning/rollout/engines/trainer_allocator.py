"""PyTorch's allocator mode across a colocated engine's sleep: expandable segments for the
trainer while the engine sleeps, plain segments while it is awake.

Why: the trainer's update fills the card with activations in large cached segments; the
tensors that outlive it (adapters, gradients, optimizer moments, the step's tables) can be
carved out of those segments, and a segment with one live block in it survives
``torch.cuda.empty_cache``. vLLM maps its weights and KV cache outside PyTorch, so at the wake
those pinned segments are memory it cannot have. With expandable segments the allocator maps
physical pages into one growing range and ``empty_cache`` unmaps every free page, so what the
trainer keeps is what is alive. The update benchmark always ran with them (its figures assume
them). vLLM's memory pool for sleep mode refuses them (0.26 asserts it at engine start; 0.32
switches them off inside its pool), so they are switched off again before the engine wakes,
and the engine's own allocations (generation, the merged sync's tensors) use plain segments.
verl switches them the same way at its trainer/rollout mode changes. A trainer with no engine in
its process (the separate layouts) allocates in them throughout (``rollout/datamodule.py``).

Contract:
- ``for_training()``: expandable segments on, every other field of the live configuration kept
  (torch parses the string whole: a bare ``expandable_segments:True`` would reset the user's
  other options for the rest of the process).
- ``for_engine()``: expandable segments off, likewise.
- A user who set ``expandable_segments:False`` in ``PYTORCH_ALLOC_CONF`` or
  ``PYTORCH_CUDA_ALLOC_CONF`` keeps plain segments throughout: both are then no-ops.
- The setting applies to segments made afterwards; existing segments keep their kind.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

_FLAG = "expandable_segments"
_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch's precedence
_written: list[str] = []  # the last configuration written here, for a torch that cannot read its own


def for_training() -> None:
    """Expandable segments on (module doc), unless the user turned them off."""
    _set_flag(True)


def for_engine() -> None:
    """Expandable segments off, before the engine maps or allocates memory (module doc)."""
    _set_flag(False)


def expandable() -> bool:
    """Whether new segments are expandable now, read from the live allocator configuration."""
    return _flag_value(_live_conf()) is True


def _set_flag(enabled: bool) -> None:
    if _flag_value(_env_conf()) is False:  # the user's explicit choice
        return
    conf = _live_conf()
    if _flag_value(conf) is enabled or (not enabled and _flag_value(conf) is None):
        return
    fields = [f.strip() for f in conf.split(",") if f.strip() and f.partition(":")[0].strip() != _FLAG]
    conf = ",".join(fields + [f"{_FLAG}:{enabled}"])
    _setter()(conf)
    _written[:] = [conf]
    if _flag_value(_live_conf()) is not enabled:  # read back: a torch that ignored it is said, not assumed
        log.warning("PyTorch's allocator did not take %s:%s (it reads %r)", _FLAG, enabled, _live_conf())


def _flag_value(conf: str):
    """True or False where ``conf`` names the flag, None where it does not."""
    for field in conf.split(","):
        name, _, value = field.partition(":")
        if name.strip() == _FLAG:
            return value.strip().lower() in ("true", "1")
    return None


def _env_conf() -> str:
    return next((os.environ[name] for name in _ENV if os.environ.get(name)), "")


def _live_conf() -> str:
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        return getter()
    return _written[0] if _written else _env_conf()


def _setter():
    return getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
