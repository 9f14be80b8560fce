"""The trainer's side of the weight-sync probe: the actor's log-probs of one token sequence.

The weight sync compares them with the engine's log-probs of the same sequence
(``Engine.prompt_logprobs``) after each sync; they must agree within a bound set from the
measured noise, never above ``rollout.max_logprob_gap``.

Who calls it: ``rollout/sync.py``.
"""

from __future__ import annotations

import torch

from .actor_critic import ActorCritic
from .packing import pack_sequences


def probe_logprobs(model: ActorCritic, token_ids: list[int], device: torch.device | str) -> list[float]:
    """Log-probs (temperature 1) of tokens ``1..len-1`` of ``token_ids``, each given the ones
    before it, under the actor adapter, in eval mode without grad (the training mode is put
    back). Collective under FSDP2: every rank calls with the same ids."""
    packed = pack_sequences([torch.tensor(token_ids, dtype=torch.int64)], [1]).to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            log_probs, _ = model.actor_forward(packed, temperature=1.0, compute_entropy=False)
    finally:
        model.train(was_training)
    return log_probs.float().cpu().tolist()
