"""Token log-probs and entropy from final hidden states, a chunk of tokens at a time.

Full-vocabulary logits for a 49,152-token micro-batch of a 248K-vocabulary model would be
48 GB in fp32, and autograd would keep several such tensors for the backward. Here a custom
autograd function runs the lm_head, log-softmax, gather and entropy on ``chunk_tokens`` rows
at a time and keeps nothing vocabulary-sized between forward and backward: it saves the
hidden states (already alive), the lm_head weight, the targets and two ``(N,)`` vectors. The
backward recomputes one chunk's logits at a time and forms their gradient in closed form,
in place:

    z = logits / T,  log p = z - logsumexp(z),  H = -sum p log p
    d log p[t] / dz = onehot(t) - p
    d H / dz        = -p * (log p + H)

so the peak is about 8-12 bytes per (chunk token x vocabulary entry): two fp32 buffers and
one buffer of the weights' dtype, whatever the micro-batch. Measured on an H200, hidden 5120,
vocabulary 248,320, bf16, forward + backward of a 49,152-token micro-batch: 11.4 GiB with
4,096-token chunks (1.6 s), 2.8 GiB with 1,024-token chunks (1.1 s; the same at 24,576 or
73,728 tokens), against 30 GiB for plain autograd at only 4,096 tokens. This is the same recompute-in-
backward as a ``torch.utils.checkpoint`` per chunk, without the two to three extra
vocabulary-sized tensors that autograd would save when replaying softmax and entropy.

Numerics (verl's, so numbers carry over): logits are the lm_head product in the weights'
dtype, upcast to fp32, divided by ``temperature`` (the rollout's sampling temperature: verl
divides logits by it before the log-softmax, so PPO ratios compare like with like with the
engine's log-probs); log-softmax, gather and entropy in fp32. With ``float32_head``
(``model.head_dtype=float32``) the product is accumulated into fp32 logits and never rounded to
the weights' dtype, as vLLM's ``head_dtype=float32`` computes them (``torch.mm(...,
out_dtype=float32)`` on a card, without an fp32 copy of the weight; operands cast to fp32
elsewhere): a bf16 logit of 20-40 is otherwise off by up to 0.06-0.125, on both sides, which
is the largest part of the trainer-engine gap on trained models that MiniMax-M1 (2506.13585)
and NeMo-RL report. Gradients reach the hidden
states in the weights' dtype (as autograd through the bf16 matmul would), and the weight and
bias when they require grad (the lm_head is frozen here, but the function does not assume it).

Who calls it: ``ActorCritic`` (actor and base passes). Pure torch.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def head_logits(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], float32_head: bool) -> Tensor:
    """``(c, V)`` fp32 logits ``hidden @ weight.T + bias``: rounded to the weights' dtype first
    (verl's numerics), or with ``float32_head`` accumulated in fp32 and never rounded (module doc)."""
    if not float32_head or hidden.dtype == torch.float32:
        return F.linear(hidden, weight, bias).float()
    if hidden.is_cuda:
        logits = torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    else:
        logits = F.linear(hidden.float(), weight.float())
    return logits if bias is None else logits.add_(bias.float())


def _chunk_log_probs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], temperature: float,
                     float32_head: bool) -> Tensor:
    """``(c, V)`` fp32 log-softmax of ``(hidden @ weight.T + bias) / temperature``, normalised in place."""
    logits = head_logits(hidden, weight, bias, float32_head)
    if temperature != 1.0:
        logits.div_(temperature)
    logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True))
    return logits


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_tokens, temperature, compute_entropy, float32_head):
        n = hidden.shape[0]
        log_probs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n if compute_entropy else 0, dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk_tokens):
            end = min(start + chunk_tokens, n)
            log_p = _chunk_log_probs(hidden[start:end], weight, bias, temperature, float32_head)
            log_probs[start:end] = log_p.gather(-1, targets[start:end, None])[:, 0]
            if compute_entropy:
                entropy[start:end] = -torch.linalg.vecdot(log_p.exp(), log_p)
        ctx.save_for_backward(hidden, weight, bias, targets, entropy)
        ctx.chunk_tokens, ctx.temperature, ctx.compute_entropy = chunk_tokens, temperature, compute_entropy
        ctx.float32_head = float32_head
        ctx.set_materialize_grads(False)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, bias, targets, entropy = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        if not ctx.compute_entropy:
            grad_entropy = None
        if grad_log_probs is None and grad_entropy is None:
            return None, None, None, None, None, None, None, None
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None
        n = hidden.shape[0]
        for start in range(0, n, ctx.chunk_tokens):
            end = min(start + ctx.chunk_tokens, n)
            h = hidden[start:end]
            log_p = _chunk_log_probs(h, weight, bias, ctx.temperature, ctx.float32_head)
            probs = log_p.exp()
            # gradient w.r.t. the tempered logits z, built in log_p's buffer
            if grad_entropy is not None:
                grad_z = log_p.add_(entropy[start:end, None]).mul_(-grad_entropy[start:end, None])
                if grad_log_probs is not None:
                    grad_z.sub_(grad_log_probs[start:end, None])
                grad_z.mul_(probs)
            else:
                grad_z = probs.mul_(-grad_log_probs[start:end, None])
            del probs, log_p
            if grad_log_probs is not None:
                rows = torch.arange(end - start, device=grad_z.device)
                grad_z.index_put_((rows, targets[start:end]), grad_log_probs[start:end], accumulate=True)
            if ctx.temperature != 1.0:
                grad_z.div_(ctx.temperature)
            grad_logits = grad_z.to(weight.dtype)
            del grad_z
            if need_hidden:
                grad_hidden[start:end] = grad_logits @ weight
            if need_weight:
                grad_weight += (grad_logits.T @ h).float()
            if need_bias:
                grad_bias += grad_logits.float().sum(0)
        return (
            grad_hidden,
            grad_weight.to(weight.dtype) if need_weight else None,
            grad_bias.to(bias.dtype) if need_bias else None,
            None, None, None, None, None,
        )


def token_logprobs_and_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    chunk_tokens: int,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    bias: Optional[Tensor] = None,
    float32_head: bool = False,
) -> tuple[Tensor, Optional[Tensor]]:
    """Log-prob of ``targets`` and entropy of the tempered distribution, per token.

    ``hidden (N, H)``: final hidden states at the positions that predict the targets.
    ``weight (V, H)`` (and optional ``bias (V,)``): the lm_head. ``targets (N,)`` int64 in
    ``[0, V)``. Returns ``log_probs (N,)`` fp32 and ``entropy (N,)`` fp32 (``None`` when
    ``compute_entropy`` is False). Differentiable in ``hidden`` (and ``weight``/``bias`` if they
    require grad); at most ``chunk_tokens x V`` logits exist at any time, forward or backward.
    ``float32_head``: logits accumulated in fp32, never rounded to the weights' dtype (module doc).
    """
    if hidden.dim() != 2 or targets.dim() != 1 or hidden.shape[0] != targets.shape[0]:
        raise ValueError(
            f"token_logprobs_and_entropy: hidden must be (N, H) and targets (N,), got "
            f"{tuple(hidden.shape)} and {tuple(targets.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"token_logprobs_and_entropy: weight {tuple(weight.shape)} does not match hidden size {hidden.shape[1]}"
        )
    if chunk_tokens <= 0:
        raise ValueError(f"token_logprobs_and_entropy: chunk_tokens={chunk_tokens} must be positive")
    if not temperature > 0:
        raise ValueError(f"token_logprobs_and_entropy: temperature={temperature} must be > 0")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= weight.shape[0]):
        raise ValueError(
            f"token_logprobs_and_entropy: target ids span {int(targets.min())}..{int(targets.max())}, "
            f"outside the vocabulary 0..{weight.shape[0] - 1}"
        )
    log_probs, entropy = _ChunkedTokenLogprobs.apply(
        hidden, weight, bias, targets.long(), int(chunk_tokens), float(temperature), bool(compute_entropy),
        bool(float32_head),
    )
    return log_probs, (entropy if compute_entropy else None)
