"""The trainer's side of the weight-sync probe: the actor's log-probs of one token sequence.

The weight sync compares them with the engine's log-probs of the same sequence
(``Engine.prompt_logprobs``) after each sync; they must agree within a bound set from the
measured noise, never above ``rollout.max_logprob_gap``. ``marked_actor`` makes the actor act
measurably whatever its state (a seeded random ``lora_B`` perturbation), for the starting check
that an engine applies what it is sent (``rollout/sync_probe.py``).

Who calls it: ``rollout/sync.py``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from .actor_critic import ACTOR, ActorCritic
from .packing import pack_sequences


def probe_logprobs(model: ActorCritic, token_ids: list[int], device: torch.device | str,
                   base: bool = False) -> list[float]:
    """Log-probs (temperature 1) of tokens ``1..len-1`` of ``token_ids``, each given the ones
    before it, under the actor adapter (``base``: with the adapters off), in eval mode without
    grad (the training mode is put back). Collective under FSDP2: every rank calls with the
    same ids."""
    packed = pack_sequences([torch.tensor(token_ids, dtype=torch.int64)], [1]).to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            if base:
                log_probs = model.base_forward(packed, temperature=1.0)
            else:
                log_probs, _ = model.actor_forward(packed, temperature=1.0, compute_entropy=False)
    finally:
        model.train(was_training)
    return log_probs.float().cpu().tolist()


#: Seeds the marked actor's direction: the same mark on every call, and each rank its own shards'.
MARK_SEED = 20261205


@contextmanager
def marked_actor(model: ActorCritic, shift: float) -> Iterator[None]:
    """Inside: the actor adapter with ``shift`` times a seeded standard normal added to every
    ``lora_B`` entry (a fresh adapter, ``lora_B = 0``, then acts through every adapted module).
    The same ``shift`` gives the same mark on every call. On leaving, the exact tensors are put
    back. In place on each rank's own shard (FSDP2: drawn for the local shard, no gather), so
    what the sync exports, merges and probes inside is the marked actor.

    Why random, not one value added to every entry: a constant shift makes each delta rank-1 with
    identical output rows, a degenerate state where bf16 engine and trainer disagree most.
    Measured (tiny bf16 hybrid, vLLM CPU engine, 99 probe tokens, both sync kinds): at the probe's
    saturated movement (2.5 in norm) the constant mark's engine-trainer gap was 1.15-1.38 (the
    actor's: 0.010) and the starting check refused the clean engine (ratio 0.36-0.38); a random
    mark of the same movement showed 0.07-0.11, a ratio of 0.03-0.04."""
    marked = [param for name, param in model.named_parameters() if f".lora_B.{ACTOR}." in name]
    if not marked:
        raise KeyError(f"no lora_B parameters of the {ACTOR} adapter to mark")
    kept = [param.detach().clone() for param in marked]
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for param in marked:
            local = param.to_local() if hasattr(param, "to_local") else param  # an FSDP2 shard in place
            # drawn where the shard lives: on the host, the 16-layer 27B hybrid's 62M lora_B
            # entries took 0.37 s (this repository's 2-core machine), at every marked load; the
            # same seed, shapes and order on one device give the same draws, all the mark needs
            if local.device not in generators:
                generators[local.device] = torch.Generator(device=local.device).manual_seed(MARK_SEED + rank)
            draw = torch.randn(local.shape, generator=generators[local.device], dtype=torch.float32,
                               device=local.device)
            local.add_((shift * draw).to(local.dtype))
    try:
        yield
    finally:
        with torch.no_grad():
            for param, value in zip(marked, kept):
                param.copy_(value)
