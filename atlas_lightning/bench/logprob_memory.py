"""Peak memory (and time) of token log-probs over a micro-batch: chunked against full logits.

Both compute, from final hidden states ``(T, H)`` bf16 and an lm_head ``(V, H)`` bf16, the
log-prob of each target token and backpropagate a loss through it to the hidden states:

* ``chunked``: ``models.logprobs.token_logprobs_and_entropy`` (what ``ActorCritic`` runs);
* ``full``: ``log_softmax((hidden @ W^T).float())`` then gather (plain autograd).

Reported: peak allocated memory above what was live before (the inputs), in GiB, and
seconds for forward + backward. The chunked peak should not depend on ``T``; the full one
grows as ``T x V``.
"""

from __future__ import annotations

import torch

from atlas_lightning.models.logprobs import token_logprobs_and_entropy

from .measure import GIB, allocated_gib, free_memory, is_oom, peak_gib, reset_peak, timed


def _inputs(tokens: int, hidden: int, vocab: int, device, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    h = (torch.randn(tokens, hidden, device=device, generator=gen) * 1.0).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, hidden, device=device, generator=gen) * 0.02).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    return h, w, targets


def _chunked(h, w, targets, chunk):
    lp, _ = token_logprobs_and_entropy(h, w, targets, chunk_tokens=chunk, compute_entropy=False)
    lp.sum().backward()


def _full(h, w, targets):
    log_probs = torch.log_softmax((h @ w.t()).float(), dim=-1)
    log_probs.gather(-1, targets[:, None]).sum().backward()


def measure_logprob_memory(device, hidden: int, vocab: int, token_counts, chunk: int) -> list[dict]:
    rows = []
    for tokens in token_counts:
        for kind in ("chunked", "full"):
            row = {"tokens": tokens, "vocab": vocab, "hidden": hidden, "kind": kind}
            try:
                h, w, targets = _inputs(tokens, hidden, vocab, device)
                fn = (lambda: _chunked(h, w, targets, chunk)) if kind == "chunked" else (lambda: _full(h, w, targets))
                fn()  # warm-up
                h.grad = None
                before = allocated_gib(device)
                reset_peak(device)
                row["seconds"] = timed(device, fn)
                peak = peak_gib(device)
                row["peak_above_inputs_gib"] = None if peak is None else peak - before
                row["logits_fp32_gib"] = tokens * vocab * 4 / GIB
            except Exception as err:
                if not is_oom(err):
                    raise
                row["error"] = "OOM"
            finally:
                h = w = targets = fn = None
                free_memory(device)
            rows.append(row)
            print(f"[bench] logprob memory {row}", flush=True)
    return rows
