"""KL estimators between the actor and the base model, and the in-reward KL penalty.

verl 0.9's ``kl_penalty`` / ``kl_penalty_forward`` and its fixed KL controller
(``verl/trainer/ppo/core_algos.py``), and a pure-tensor twin of
``apply_kl_penalty`` (``verl/trainer/ppo/ray_trainer.py``), which in verl edits a DataProto.
All tensors are ``(bs, response_length)`` per-token log-probs of the sampled tokens.

Estimators (J. Schulman, "Approximating KL divergence", 2020), with d = logprob - ref_logprob:
  ``kl``/``k1``: d;  ``abs``: |d|;  ``mse``/``k2``: d^2 / 2;
  ``low_var_kl``/``k3``: exp(-d) + d - 1, with -d clamped to [-20, 20] before exp and the
  result clamped to [-10, 10] (verl's guards against overflow on rare tokens).
A trailing ``+`` (``k3+``, ``low_var_kl+``, ``k1+``...) keeps that estimator's value but
takes k2's gradient (a straight-through estimator whose gradient is unbiased for KL).

Who calls it: the PPO step (``use_kl_loss``: the actor's KL loss; ``use_kl_in_reward``:
``apply_kl_penalty`` before GAE). Only a fixed coefficient is configured in this project
(``algorithm.kl_coef``); ``apply_kl_penalty`` also takes any controller with ``value`` and
``update`` (verl's adaptive one is the tests' reference, ``tests/algorithms/verl_reference.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from .functional import masked_mean

__all__ = [
    "FixedKLController",
    "KL_PENALTY_NAMES",
    "apply_kl_penalty",
    "kl_penalty",
    "kl_penalty_forward",
]

#: Accepted estimator names (each may also carry a trailing ``+``).
KL_PENALTY_NAMES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def kl_penalty_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """The per-token KL estimate named ``kl_penalty`` (no ``+`` here); see the module doc."""
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        log_ratio = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        estimate = (torch.exp(log_ratio) - log_ratio - 1).contiguous()
        return torch.clamp(estimate, min=-10, max=10)
    raise NotImplementedError(
        f"kl_penalty={kl_penalty!r} is not supported; use one of {', '.join(KL_PENALTY_NAMES)} "
        "(optionally with a trailing '+'). 'full' needs whole-vocabulary log-probs and is not implemented."
    )


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate, ``(bs, T), (bs, T) -> (bs, T)``; a trailing ``+`` swaps in k2's gradient."""
    return _kl_estimate(logprob, ref_logprob, kl_penalty)


def _kl_estimate(logprob: torch.Tensor, ref_logprob: torch.Tensor, name: str) -> torch.Tensor:
    if logprob.shape != ref_logprob.shape:
        raise ValueError(
            f"kl_penalty: logprob shape {tuple(logprob.shape)} differs from ref_logprob shape {tuple(ref_logprob.shape)}"
        )
    straight_through = name.endswith("+")
    base = name[:-1] if straight_through else name
    forward = kl_penalty_forward(logprob, ref_logprob, base)
    if not straight_through or name in ("mse", "k2"):
        return forward
    # Value of the named estimator, gradient of k2 (whose expected gradient is KL's).
    k2 = 0.5 * (logprob - ref_logprob).square()
    return k2 - k2.detach() + forward.detach()


class FixedKLController:
    """A constant KL coefficient (``value``); ``update`` is a no-op. This project's default."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: Any,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL in the reward: ``token_level_rewards = token_level_scores - beta * kld * response_mask``.

    The pure twin of verl's ``ray_trainer.apply_kl_penalty`` (which reads and writes a
    DataProto). ``kl_ctrl`` is a controller (``.value``, ``.update(current_kl, n_steps)``)
    or a plain float coefficient (a fixed controller). The controller is updated with the
    batch's KL as verl does: the masked per-sequence mean, averaged over sequences, with
    ``n_steps`` = batch size.

    Returns ``(token_level_rewards, metrics)`` with verl's metric names
    ``actor/reward_kl_penalty`` (that KL) and ``actor/reward_kl_penalty_coeff`` (beta used).
    """
    for name, tensor in (("old_log_probs", old_log_probs), ("ref_log_prob", ref_log_prob), ("response_mask", response_mask)):
        if tensor.shape != token_level_scores.shape:
            raise ValueError(
                f"apply_kl_penalty: {name} shape {tuple(tensor.shape)} differs from token_level_scores shape "
                f"{tuple(token_level_scores.shape)}"
            )
    controller = FixedKLController(float(kl_ctrl)) if isinstance(kl_ctrl, (int, float)) else kl_ctrl
    kld = _kl_estimate(old_log_probs, ref_log_prob, kl_penalty) * response_mask
    beta = controller.value
    token_level_rewards = token_level_scores - beta * kld
    current_kl = torch.mean(masked_mean(kld, mask=response_mask, axis=-1), dim=0).item()
    controller.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, metrics
