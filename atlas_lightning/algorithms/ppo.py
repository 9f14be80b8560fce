"""The PPO maths with verl 0.9's names, signatures and numerics.

The twin of ``verl/trainer/ppo/core_algos.py`` for what this project uses: GAE, the clipped
(dual-clip) policy loss, the clipped value loss, loss aggregation and, re-exported from
``kl.py``/``functional.py``, the KL estimators and masked helpers. verl's functions the step
does not run (the old-style ``compute_policy_loss``, ``compute_entropy_loss``, ...) are not
here; ``tests/algorithms/verl_parity.py`` checks ours against verl's, those included. Same
argument names, order, defaults and return tuples as verl; the arithmetic follows verl's
order so that results agree bit for bit (``tests/algorithms/verl_parity.py``).

Shapes: every per-token tensor is ``(bs, response_length)``; ``response_mask`` is 1 on the
tokens the policy generated and 0 on prompt padding, tool responses and right padding.
Losses are scalars to minimise. Unlike verl, bad shapes and arguments raise ``ValueError``
naming the argument instead of failing deep inside torch.

Who calls it: the PPO step in ``ppo/module.py`` (advantages once per RL step; the losses on
every micro-batch).

Data-parallel loss semantics (``agg_loss``): a rank's micro-batch loss is normalised by the
*global* mini-batch (``batch_num_tokens``: valid tokens on all ranks; ``global_batch_size``:
sequences on all ranks) and multiplied by ``dp_size``. Summing the micro-batch gradients on
a rank and averaging over ranks (what FSDP/DDP reduce-scatter does) then yields the gradient
of the global mini-batch loss, however the mini-batch was split. Left at their defaults,
they normalise by the micro-batch itself (verl's single-process behaviour).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

from .functional import (
    clip_by_value,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from .kl import (
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
    kl_penalty_forward,
)

__all__ = [
    "BEHAVIOUR_WEIGHT_MODES",
    "LOSS_AGG_MODES",
    "OFF_POLICY_LOSSES",
    "FixedKLController",
    "behaviour_importance_weights",
    "agg_loss",
    "apply_kl_penalty",
    "clip_by_value",
    "compute_gae_advantage_return",
    "compute_policy_loss_decoupled",
    "compute_policy_loss_vanilla",
    "compute_value_loss",
    "kl_penalty",
    "kl_penalty_forward",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]

#: verl 0.9's aggregation modes (``token-sum`` is verl's too; the config offers the other four).
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _check_same_shape(where: str, reference: str, **tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the first tensor whose shape differs from ``tensors[reference]``."""
    expected = tensors[reference].shape
    for name, tensor in tensors.items():
        if tensor.shape != expected:
            raise ValueError(
                f"{where}: {name} has shape {tuple(tensor.shape)}, expected {tuple(expected)} (the shape of {reference})"
            )


# ----------------------------------------------------------------------------- advantages


def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over response tokens that steps over masked (tool/padding) tokens.

    Args: three ``(bs, response_length)`` tensors (rewards per token, the critic's values at
    rollout time, the response mask), the discount ``gamma`` and GAE ``lam``, and ``whiten``
    (verl's behaviour, the default: whiten the advantages over this call's batch; False leaves
    that to the caller, e.g. a step that whitens over the tokens of every rank at once).

    The recursion runs right to left over positions. At a position with mask 1 it is the
    usual ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lam * A_next``,
    where ``V_next``/``A_next`` belong to the next *unmasked* token to the right (0 past the
    last one). At a position with mask 0 nothing is computed: the carried ``V_next`` and
    ``A_next`` pass through unchanged, so a tool response in the middle of a response is
    transparent and its rewards and values are ignored, and the masked position's own
    (pre-whitening) advantage is the carried ``A_next``.

    Returns ``(advantages, returns)``, both ``(bs, response_length)``:
    ``returns = A + values`` with the raw ``A``; ``advantages = masked_whiten(A, response_mask)``
    (mean and unbiased std over all unmasked tokens of the batch, so the batch needs at least
    two of them), or the raw ``A`` itself when ``whiten`` is False. No gradient flows (computed
    under ``torch.no_grad``).
    """
    _check_same_shape(
        "compute_gae_advantage_return", "token_level_rewards",
        token_level_rewards=token_level_rewards, values=values, response_mask=response_mask,
    )
    if token_level_rewards.dim() != 2 or token_level_rewards.shape[-1] == 0:
        raise ValueError(
            "compute_gae_advantage_return: tensors must be (bs, response_length) with response_length > 0, "
            f"got shape {tuple(token_level_rewards.shape)}"
        )
    with torch.no_grad():
        # Arithmetic mask (bool masks allowed) for the carry-over blends below.
        mask = response_mask.to(values.dtype)
        next_value = 0
        next_advantage = 0
        reversed_advantages = []
        for t in reversed(range(token_level_rewards.shape[-1])):
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
            advantage_here = delta + gamma * lam * next_advantage
            # Blend rather than index so that a masked token hands the carried quantities on unchanged.
            next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
            next_advantage = advantage_here * mask[:, t] + (1 - mask[:, t]) * next_advantage
            reversed_advantages.append(next_advantage)
        advantages = torch.stack(reversed_advantages[::-1], dim=1)
        returns = advantages + values
        if whiten:
            advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


# ----------------------------------------------------------------------------- aggregation


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: Optional[int] = None,
    global_batch_size: Optional[int] = None,
    loss_scale_factor: Optional[int] = None,
) -> torch.Tensor:
    """Reduce a ``(bs, response_length)`` per-token loss of one micro-batch to a scalar.

    Modes (s_i = sum of sequence i's masked token losses, n_i its mask count; sequences with
    n_i = 0 are left out of the seq-mean modes):
      ``token-mean``:               sum_i s_i / batch_num_tokens * dp_size
      ``token-sum``:                sum_i s_i * dp_size
      ``seq-mean-token-sum``:       sum_i s_i / global_batch_size * dp_size
      ``seq-mean-token-mean``:      sum_i (s_i / (n_i + 1e-8)) / global_batch_size * dp_size
      ``seq-mean-token-sum-norm``:  the ``seq-mean-token-sum`` value / loss_scale_factor
    ``batch_num_tokens`` defaults to this micro-batch's mask count, ``global_batch_size`` to
    its number of non-empty sequences, ``loss_scale_factor`` to ``response_length``. With
    ``dp_size > 1`` the global counts must be given (see the module doc). An all-masked
    micro-batch with local normalisation gives NaN (0/0), as verl; pass the global counts.
    """
    if loss_mat.shape != loss_mask.shape:
        raise ValueError(
            f"agg_loss: loss_mat shape {tuple(loss_mat.shape)} differs from loss_mask shape {tuple(loss_mask.shape)}"
        )
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("agg_loss: token-mean with dp_size > 1 needs batch_num_tokens (valid tokens on all ranks)")
            batch_num_tokens = loss_mask.sum()
        return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if loss_agg_mode == "token-sum":
        # Gradient averaging over ranks divides by dp_size; multiplying it back gives the global sum.
        return masked_sum(loss_mat, loss_mask) * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        if global_batch_size is None:
            if dp_size > 1:
                raise ValueError(f"agg_loss: {loss_agg_mode} with dp_size > 1 needs global_batch_size (all ranks' sequences)")
            global_batch_size = seq_mask.sum()
        loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            if loss_scale_factor is None:
                loss_scale_factor = loss_mask.shape[-1]
            loss /= loss_scale_factor
        return loss
    if loss_agg_mode == "seq-mean-token-mean":
        token_counts = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (token_counts + 1e-8)
        seq_mask = (token_counts > 0).float()
        if global_batch_size is None:
            if dp_size > 1:
                raise ValueError(f"agg_loss: {loss_agg_mode} with dp_size > 1 needs global_batch_size (all ranks' sequences)")
            global_batch_size = seq_mask.sum()
        return masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
    raise ValueError(f"agg_loss: loss_agg_mode={loss_agg_mode!r} is not one of {', '.join(LOSS_AGG_MODES)}")


# ----------------------------------------------------------------------------- actor


def _clipped_surrogate(old_log_prob, log_prob, advantages, response_mask, cliprange_low, cliprange_high, clip_ratio_c):
    """Per-token dual-clip PPO loss and its diagnostics (verl's vanilla policy loss).

    Returns ``(pg_losses, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``: the ``(bs, T)`` loss
    matrix, the masked fraction of tokens where the ratio clip bound, the masked mean of
    ``old_log_prob - log_prob`` (k1 KL), and the masked fraction where the dual clip bound.
    """
    _check_same_shape(
        "policy loss", "log_prob",
        old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask,
    )
    if not clip_ratio_c > 1.0:
        raise ValueError(f"policy loss: clip_ratio_c={clip_ratio_c} must be > 1.0 (the dual-clip bound on the ratio)")
    if cliprange_low is None or cliprange_high is None:
        raise ValueError("policy loss: the config needs clip_ratio, or both clip_ratio_low and clip_ratio_high")
    # exp of a log-ratio beyond +-20 overflows float16/bf16 and only happens on garbage tokens.
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask)

    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    pessimistic = torch.maximum(unclipped, clipped)
    pg_clipfrac = masked_mean(torch.gt(clipped, unclipped).float(), response_mask)

    # Dual clip (arXiv:1912.09729): for A < 0 the loss is capped at -A * clip_ratio_c.
    dual_bound = -advantages * clip_ratio_c
    dual_clipped = torch.min(dual_bound, pessimistic)
    pg_clipfrac_lower = masked_mean(torch.gt(pessimistic, dual_bound) * (advantages < 0).float(), response_mask)

    pg_losses = torch.where(advantages < 0, dual_clipped, pessimistic)
    return pg_losses, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def _config_value(config: Any, key: str, default: Any) -> Any:
    value = config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)
    return default if value is None else value


def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    *,
    global_batch_info: Optional[Mapping[str, Any]] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl 0.9's config-based policy loss (registered there as ``"vanilla"``).

    ``config`` supplies the clip ranges: verl's ActorConfig (``clip_ratio``,
    ``clip_ratio_low``/``high`` defaulting to it, ``clip_ratio_c``, ``global_batch_info``),
    this project's ``AlgorithmConfig`` (``clip_ratio_low``/``high``/``c``), or a mapping with
    those keys. ``global_batch_info`` (``dp_size``, ``batch_num_tokens``, ``global_batch_size``,
    ``loss_scale_factor``; keyword-only, our addition) is merged over the config's and handed
    to ``agg_loss`` for data-parallel normalisation. ``rollout_is_weights`` (``(bs, T)``)
    multiplies the per-token losses before aggregation.

    Returns ``(pg_loss, metrics)`` with metrics ``actor/pg_clipfrac``, ``actor/ppo_kl``,
    ``actor/pg_clipfrac_lower`` as Python floats.
    """
    if config is None:
        raise ValueError("compute_policy_loss_vanilla: config is required (it carries the clip ratios)")
    clip_ratio = _config_value(config, "clip_ratio", None)
    cliprange_low = _config_value(config, "clip_ratio_low", clip_ratio)
    cliprange_high = _config_value(config, "clip_ratio_high", clip_ratio)
    clip_ratio_c = _config_value(config, "clip_ratio_c", 3.0)
    batch_info = dict(_config_value(config, "global_batch_info", {}))
    batch_info.update(global_batch_info or {})

    pg_losses, pg_clipfrac, ppo_kl, pg_clipfrac_lower = _clipped_surrogate(
        old_log_prob, log_prob, advantages, response_mask, cliprange_low, cliprange_high, clip_ratio_c
    )
    if rollout_is_weights is not None:
        _check_same_shape(
            "compute_policy_loss_vanilla", "pg_losses", pg_losses=pg_losses, rollout_is_weights=rollout_is_weights
        )
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **batch_info)
    metrics = {
        "actor/pg_clipfrac": pg_clipfrac.detach().item(),
        "actor/ppo_kl": ppo_kl.detach().item(),
        "actor/pg_clipfrac_lower": pg_clipfrac_lower.detach().item(),
    }
    return pg_loss, metrics


# ----------------------------------------------------------------------------- off-policy correction

#: ``algorithm.off_policy_loss``: ``none`` (the trainer's old log-probs are the behaviour policy:
#: ``compute_policy_loss_vanilla``, bit for bit what the step has always run) or ``decoupled``
#: (``compute_policy_loss_decoupled``).
OFF_POLICY_LOSSES = ("none", "decoupled")
#: ``algorithm.behav_imp_weight_mode``: what a behaviour weight above the cap becomes.
BEHAVIOUR_WEIGHT_MODES = ("truncate", "mask")
#: A log-ratio beyond this is a garbage token; exp of it would overflow (verl's SAFETY_BOUND).
_LOG_RATIO_BOUND = 20.0


def behaviour_importance_weights(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                                 response_mask: torch.Tensor, cap: float,
                                 mode: str = "truncate") -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token behaviour importance weights ``w = pi_prox / pi_behav``, capped.

    ``old_log_prob``: the proximal policy's log-probs (the trainer's, before this step's
    update); ``rollout_log_prob``: the behaviour policy's (the engine's, for the weights each
    token was sampled with); ``response_mask``: 1 on generated tokens. All ``(bs, T)``.

    ``mode``: ``truncate`` gives ``min(w, cap)`` (truncated importance sampling, verl's TIS);
    ``mask`` gives 0 where ``w > cap`` and ``w`` elsewhere (AReaL's ``behav_imp_weight_cap``,
    which filters such tokens out of the loss). Either way the weight is 0 off the mask, and
    no gradient flows through it (it changes the measure, not the objective).

    Returns ``(weights, metrics)``: ``actor/behav_imp_weight_mean`` (masked mean of the capped
    weights), ``actor/behav_capped_frac`` (masked fraction of tokens above the cap),
    ``actor/behav_kl`` (masked mean of ``rollout_log_prob - old_log_prob``, k1 from the
    proximal to the behaviour policy: 0 when the engine sampled with the trainer's weights
    exactly).
    """
    _check_same_shape("behaviour_importance_weights", "old_log_prob", old_log_prob=old_log_prob,
                      rollout_log_prob=rollout_log_prob, response_mask=response_mask)
    if mode not in BEHAVIOUR_WEIGHT_MODES:
        raise ValueError(f"behaviour_importance_weights: mode={mode!r} is not one of {', '.join(BEHAVIOUR_WEIGHT_MODES)}")
    if not cap >= 1.0:
        raise ValueError(f"behaviour_importance_weights: cap={cap} must be >= 1 (a weight of 1 is on-policy)")
    with torch.no_grad():
        log_ratio = old_log_prob - rollout_log_prob
        weights = torch.exp(torch.clamp(log_ratio, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))
        above = weights > cap
        weights = torch.clamp(weights, max=cap) if mode == "truncate" else torch.where(above, 0.0, weights)
        weights = weights * response_mask.to(weights.dtype)
        metrics = {
            "actor/behav_imp_weight_mean": masked_mean(weights, response_mask).item(),
            "actor/behav_capped_frac": masked_mean(above.to(weights.dtype), response_mask).item(),
            "actor/behav_kl": masked_mean(-log_ratio, response_mask).item(),
        }
    return weights, metrics


def compute_policy_loss_decoupled(
    old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    rollout_log_prob: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None, *,
    global_batch_info: Optional[Mapping[str, Any]] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The decoupled PPO loss of AReaL (arXiv:2505.24298), for rollouts sampled with older weights.

    Three policies: the behaviour policy that sampled each token (``rollout_log_prob``, the
    engine's), the proximal policy (``old_log_prob``, the trainer's forward pass before this
    step's update) and the current one (``log_prob``). The trust region is taken around the
    proximal policy, not the behaviour one::

        loss_t = w_t * dualclip(max(-A_t r_t, -A_t clip(r_t, 1 - low, 1 + high)))
        r_t = pi_theta / pi_prox,   w_t = cap(pi_prox / pi_behav)   (no gradient through w)

    ``w`` is ``behaviour_importance_weights`` (``config``: ``behav_imp_weight_cap``,
    ``behav_imp_weight_mode``); the rest is ``compute_policy_loss_vanilla`` (same ``config``
    clip keys, ``global_batch_info`` and aggregation) with ``rollout_is_weights=w``. When the
    engine sampled with the trainer's weights exactly (``rollout_log_prob == old_log_prob``)
    every ``w`` is 1 and the loss is the vanilla one, bit for bit.

    Against verl's rollout correction (``rollout_corr_helper``; ``algorithm.rollout_correction``):
    the same: verl's "decoupled" mode is this objective, its proximal policy the recomputed
    ``old_log_prob``, its token-level TIS weights ``min(pi_old / pi_rollout, threshold)``
    multiplied into the per-token PPO loss, detached (``mode=truncate`` here). What differs:
    AReaL's cap filters rather than truncates (``mode=mask``: weight 0 above the cap; the token
    stays in the loss's denominator); verl's rejection sampling (MIS) also rejects weights
    below ``1/threshold`` and drops rejected tokens from the denominator, offers sequence-level
    and geometric weights, batch-normalised weights and a "bypass" mode that skips the proximal
    forward pass (``old = rollout``), none of which is here. Both target the same two gaps:
    staleness (older weights) and the engine/trainer numerical mismatch.

    Returns ``(pg_loss, metrics)``: ``compute_policy_loss_vanilla``'s metrics (clip fractions
    and ``ppo_kl`` against the proximal policy) and ``behaviour_importance_weights``'.
    """
    if config is None:
        raise ValueError("compute_policy_loss_decoupled: config is required (clip ratios, behaviour weight cap)")
    weights, behaviour = behaviour_importance_weights(
        old_log_prob, rollout_log_prob, response_mask, cap=float(_config_value(config, "behav_imp_weight_cap", 5.0)),
        mode=str(_config_value(config, "behav_imp_weight_mode", "truncate")))
    pg_loss, metrics = compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                                                   config, rollout_is_weights=weights.to(log_prob.dtype),
                                                   global_batch_info=global_batch_info)
    metrics.update(behaviour)
    return pg_loss, metrics


# ----------------------------------------------------------------------------- critic


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: Optional[int] = None,
    global_batch_size: Optional[int] = None,
    loss_scale_factor: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss: ``0.5 * agg(max((v - R)^2, (clip(v, V_old +- cliprange_value) - R)^2))``.

    ``vpreds`` are the critic's current predictions, ``values`` its rollout-time ones,
    ``returns`` the GAE returns, all ``(bs, response_length)``. The trailing arguments go to
    ``agg_loss`` (data-parallel normalisation, see the module doc).

    Returns ``(vf_loss, vf_clipfrac)``: the loss and the masked fraction of tokens where the
    clipped error was the larger one (0-dim tensors).
    """
    _check_same_shape(
        "compute_value_loss", "vpreds", vpreds=vpreds, returns=returns, values=values, response_mask=response_mask,
    )
    if cliprange_value < 0:
        raise ValueError(f"compute_value_loss: cliprange_value={cliprange_value} must be >= 0")
    vpred_clipped = clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped_error = (vpreds - returns) ** 2
    clipped_error = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(
        loss_mat=torch.max(unclipped_error, clipped_error),
        loss_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    vf_clipfrac = masked_mean(torch.gt(clipped_error, unclipped_error).float(), response_mask)
    return vf_loss, vf_clipfrac
