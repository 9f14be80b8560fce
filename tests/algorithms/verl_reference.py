"""verl 0.9 functions that this project's step does not run, kept as references for the tests.

The trainer computes log-probs and entropy chunk by chunk from hidden states
(``atlas_lightning/models/logprobs.py``), uses a fixed in-reward KL coefficient, and takes
its policy loss from ``compute_policy_loss_vanilla``. verl's full-logits helpers, its
old-style entropy loss, ``compute_rewards`` and the adaptive KL controller therefore live
here, beside the tests that use them: ``test_algo_functional.py`` and ``test_algo_losses.py``
pin their numbers, ``test_algo_kl.py`` drives the production ``apply_kl_penalty`` with the
adaptive controller, and ``verl_parity.py`` checks each of them against verl's own code.

Nothing here imports ``atlas_lightning``: a test that compares production code with one of
these compares two independent implementations. Pure torch (and numpy for the controller).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of the categorical distribution of each row: ``(..., vocab) -> (...)``.

    H = logsumexp(z) - sum softmax(z) * z, which never forms log(0) (verl's
    ``torch_functional.entropy_from_logits``).
    """
    probs = F.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(probs * logits, dim=-1)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True) -> torch.Tensor:
    """Log-probability of ``labels`` under ``logits``: ``(..., vocab), (...) -> (...)``.

    verl's CPU path (``logprobs_from_logits_v2``): for float32/float64, the label's logit
    minus a row-by-row logsumexp; for half precision, a row-by-row log_softmax (logsumexp
    in bf16 is too coarse). Rows are the first dimension, processed one at a time.
    ``inplace_backward`` only concerns verl's flash-attn kernel and is accepted for
    signature parity. Bad shapes raise ``ValueError`` naming them.
    """
    del inplace_backward
    if logits.dim() < 2:
        raise ValueError(f"logprobs_from_logits: logits must be (rows, ..., vocab), got shape {tuple(logits.shape)}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"logprobs_from_logits: labels shape {tuple(labels.shape)} must equal logits shape "
            f"without the vocabulary dimension {tuple(logits.shape[:-1])}"
        )
    if logits.shape[0] == 0:
        return logits.new_empty(labels.shape)
    if logits.dtype in (torch.float32, torch.float64):
        label_logits = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
        normalisers = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        return label_logits - normalisers
    rows = []
    for row_logits, row_labels in zip(logits, labels, strict=True):
        row_logprobs = F.log_softmax(row_logits, dim=-1)
        rows.append(row_logprobs.gather(dim=-1, index=row_labels.unsqueeze(-1)).squeeze(-1))
    return torch.stack(rows)


def compute_entropy_loss(logits, response_mask, loss_agg_mode: str = "token-mean"):
    """Mean entropy of ``(bs, T, vocab)`` logits over the response mask, a 0-dim tensor (verl's
    ``core_algos.compute_entropy_loss``). Only verl's default ``token-mean`` is written out here:
    the other aggregation modes are ``agg_loss``'s, which the production code has and the
    tests check on their own."""
    if loss_agg_mode != "token-mean":
        raise NotImplementedError(f"the reference entropy loss aggregates token-mean only, not {loss_agg_mode!r}")
    token_entropy = entropy_from_logits(logits)
    kept = torch.where(response_mask.bool(), token_entropy, 0.0)
    return (kept * response_mask).sum() / response_mask.sum()


def compute_rewards(token_level_scores, old_log_prob, ref_log_prob, kl_ratio):
    """verl's older helper: ``token_level_scores - kl_ratio * (old_log_prob - ref_log_prob)`` (k1, unmasked)."""
    kl = old_log_prob - ref_log_prob
    return token_level_scores - kl * kl_ratio


class AdaptiveKLController:
    """Ziegler et al. 2019 (arXiv:1909.08593): moves ``value`` toward ``target_kl``.

    ``value *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon``; a
    ``horizon`` that is not positive raises ``ValueError``.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if horizon <= 0:
            raise ValueError(f"AdaptiveKLController: horizon={horizon} must be > 0")
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = np.clip(current_kl / self.target - 1, -0.2, 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon
