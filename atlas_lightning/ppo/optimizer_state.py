"""The optimizers' state made before the first update, where the caching allocator puts it apart.

An optimizer such as AdamW makes its moments lazily, at its first ``step``: on a card that is
after the first mini-batch's backward, in the cached blocks its activations have just left. Each
moment then holds its block's whole segment, which ``torch.cuda.empty_cache`` cannot return, and
the segments such small, lasting tensors hold add up to gigabytes that a colocated engine waking
after the update does not find (its own allocator maps memory outside PyTorch's). On an H100
the 8B step's wake after its first update ran out of memory that way. The step keeps its lasting
tensors out of the activations' segments in three places (``ppo/module.py``): the moments are made
here, before any activation; the gradients, made in the backward among the activations, are freed
after each role's last optimizer step; and each forward-only pass returns its cached segments
before the step's next lasting tensors (the next pass's outputs, the advantages) are made.

``allocate`` makes the state as the optimizer's own first step makes it, before any activation
exists: one step at learning rate 0 and weight decay 0 on zero gradients, which leaves every
parameter as it was (Adam's step is ``lr * m / (sqrt(v) + eps)`` with ``m = v = 0``), then the
step counters set back to 0. The state is then the lazily made one, tensor for tensor, dtypes and
devices included (``tests/ppo/test_optimizer_state.py``), whatever the optimizer's options.
"""

from __future__ import annotations

import torch

#: The options set to 0 for the allocating step (each, where the optimizer's groups have it).
_NEUTRAL = ("lr", "weight_decay")


@torch.no_grad()
def allocate(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer``'s per-parameter state now, equal to what its first step would make,
    changing no parameter; a no-op for parameters that already have state (a resumed run)."""
    params = [p for group in optimizer.param_groups for p in group["params"]
              if p.requires_grad and not optimizer.state.get(p)]
    if not params:
        return
    saved = [{key: group[key] for key in _NEUTRAL if key in group} for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        for key in _NEUTRAL:
            if key in group:
                group[key] = 0.0
    grads = {p: p.grad for p in params}
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
    finally:
        for group, options in zip(optimizer.param_groups, saved):
            group.update(options)
        for p, grad in grads.items():
            p.grad = grad
    for p in params:
        step = optimizer.state[p].get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif step is not None:
            optimizer.state[p]["step"] = type(step)(0)
