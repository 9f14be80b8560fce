"""Choose which LoRA adapter a forward uses, without touching ``requires_grad``.

peft's own switches flip ``requires_grad``: ``set_adapter`` freezes every inactive adapter and
``disable_adapter()`` freezes them all, then unfreezes only the active one on exit. With the
actor and the critic trained at the same time on one base, both adapters must stay trainable
throughout (their optimizers hold them, and FSDP2 copies the flag onto its unsharded
parameters when it sets them up, so flipping it between passes is unsafe). So the selection
here writes only the two fields each tuner layer's forward reads, ``_active_adapter`` and
``_disable_adapters`` (private to peft; the tests pin the behaviour for peft 0.21). An adapter
that does not take part in a forward gets no gradient from it (its ``.grad`` stays ``None``):
that is how gradients of the actor loss reach only the actor adapter and those of the value
loss only the critic's.

Gradient checkpointing replays a layer's forward during backward, after the selecting
context has exited and possibly while another adapter is selected. ``checkpoint_keeping_adapter``
captures the selection at forward time and re-applies it around the replay, so the recomputed
activations are those of the adapter that made them.

Who calls it: ``ActorCritic`` only.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import Iterator, Optional, Sequence

from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn
from torch.utils.checkpoint import checkpoint

#: What a tuner layer's forward reads: (active adapter name, adapters disabled).
AdapterState = tuple[object, bool]


def tuner_layers(module: nn.Module) -> list[BaseTunerLayer]:
    """The peft tuner layers (LoRA-wrapped linears) under ``module``, in module order."""
    return [m for m in module.modules() if isinstance(m, BaseTunerLayer)]


def _read(layers: Sequence[BaseTunerLayer]) -> Optional[AdapterState]:
    if not layers:
        return None
    return (layers[0]._active_adapter, layers[0]._disable_adapters)


def _write(layers: Sequence[BaseTunerLayer], state: Optional[AdapterState]) -> None:
    if state is None:
        return
    active, disabled = state
    for layer in layers:
        if layer.merged:
            raise RuntimeError(
                f"{type(layer).__name__} has merged adapters {layer.merged_adapters}: an adapter cannot be "
                f"selected per forward once merged into the base weights"
            )
        layer._active_adapter = active
        layer._disable_adapters = disabled


@contextmanager
def selected_adapter(layers: Sequence[BaseTunerLayer], adapter: Optional[str]) -> Iterator[None]:
    """Inside the block, ``layers`` use ``adapter`` (``None``: the bare base model); the
    previous selection comes back on exit. ``requires_grad`` is left alone."""
    previous = _read(layers)
    _write(layers, (adapter, False) if adapter is not None else (previous[0] if previous else None, True))
    try:
        yield
    finally:
        _write(layers, previous)


def _replay_with(layers: Sequence[BaseTunerLayer], state: Optional[AdapterState], function, *args, **kwargs):
    current = _read(layers)
    _write(layers, state)
    try:
        return function(*args, **kwargs)
    finally:
        _write(layers, current)


def checkpoint_keeping_adapter(layers: Sequence[BaseTunerLayer]):
    """A ``_gradient_checkpointing_func`` for one decoder layer whose tuner layers are
    ``layers``: non-reentrant ``torch.utils.checkpoint`` whose replay runs under the adapter
    selection that was in force when the forward ran."""

    def checkpoint_func(function, *args, **kwargs):
        state = _read(layers)
        return checkpoint(partial(_replay_with, layers, state, function), *args, use_reentrant=False, **kwargs)

    return checkpoint_func
