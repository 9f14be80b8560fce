"""What ``model.head_dtype`` changes in the trainer's log-probs, and what it costs: the chunked
lm_head (``models.logprobs.token_logprobs_and_entropy``, what ``ActorCritic`` runs) with each head
dtype, against a float64 reference of the same bf16 operands.

    atlas-lightning bench head-dtype --device cuda --out head.json          # the report's head: 5,120 x 248,320
    atlas-lightning bench head-dtype --tokens 64 --hidden 64 --vocab 500     # a CPU smoke run

Inputs: ``--tokens`` bf16 hidden states (standard normal, as a final RMSNorm leaves them) and a bf16
head scaled so that logits spread with standard deviation ``--logit-scale`` (8: the top logits of a
batch reach 30-40, as a trained model's do; random-initialised models have logits near 0, where the
head's rounding vanishes), random targets. For each head dtype (``model``: logits rounded to bf16,
verl's numerics; ``float32``: accumulated in float32, never rounded): the mean and largest
|Δ log p| against the reference, and the best of ``--reps`` forward + backward passes (seconds, the
peak allocated on a card). JSON on stdout (``--out``: also a file).

Measured on an H100 (2026-12-07, torch 2.11, the report's head, 8,192 tokens, 1,024-token chunks;
the same function run from the module's file, before this command existed): rounded logits 0.040
mean, 0.161 largest; float32 logits 0.00018 and 0.00040; forward + backward 0.192 s and 0.183 s,
peak 5.4 and 5.6 GiB (``bench/results/h100-head-dtype.log``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from atlas_lightning.models.logprobs import token_logprobs_and_entropy
from atlas_lightning.store.files import atomic_write_json

from .measure import repeat

HEADS = ("model", "float32")


def inputs(tokens: int, hidden: int, vocab: int, logit_scale: float, device, seed: int = 0):
    """bf16 ``(hidden states (T, H), head (V, H), targets (T,))`` (module doc)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(tokens, hidden, device=device, generator=gen).bfloat16()
    w = (torch.randn(vocab, hidden, device=device, generator=gen) * (logit_scale / hidden ** 0.5)).bfloat16()
    return h, w, torch.randint(0, vocab, (tokens,), device=device, generator=gen)


def reference(h, w, targets, rows: int = 512) -> tuple[torch.Tensor, float]:
    """float64 log-probs of ``targets`` from the exact product of the bf16 operands, ``rows`` at a
    time, and the largest |logit| of the batch."""
    wd, parts, largest = w.double().T, [], 0.0
    for i in range(0, h.shape[0], rows):
        logits = h[i:i + rows].double() @ wd
        largest = max(largest, logits.abs().max().item())
        parts.append(torch.log_softmax(logits, -1).gather(-1, targets[i:i + rows, None])[:, 0])
    return torch.cat(parts), largest


def measure(h, w, targets, exact, *, head_dtype: str, chunk: int, reps: int) -> dict:
    """One head dtype: its distance from ``exact`` and the best forward + backward of ``reps``
    (after one warm-up, ``measure.repeat``), with their peak on a card."""
    hidden = h.clone().requires_grad_(True)
    last = {}

    def forward_backward() -> None:
        hidden.grad = None
        log_probs, entropy = token_logprobs_and_entropy(hidden, w, targets, chunk_tokens=chunk,
                                                        float32_head=head_dtype == "float32")
        (log_probs.sum() + entropy.sum()).backward()
        last["log_probs"] = log_probs.detach()

    timing = repeat(h.device, forward_backward, reps)
    gap = (last["log_probs"].double() - exact).abs()
    return {"mean_abs_gap": gap.mean().item(), "max_abs_gap": gap.max().item(), "seconds": min(timing["times_s"]),
            "peak_gib": timing["peak_gib"]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="atlas-lightning bench head-dtype", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=5120, help="the report's: Qwen3.6-27B's hidden size")
    p.add_argument("--vocab", type=int, default=248320, help="the report's: Qwen3.6-27B's vocabulary")
    p.add_argument("--chunk", type=int, default=1024, help="model.logprob_chunk_tokens")
    p.add_argument("--logit-scale", type=float, default=8.0, help="the logits' standard deviation")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device here (--device cpu with small --hidden and --vocab)")
    if min(args.tokens, args.hidden, args.vocab, args.chunk, args.reps) < 1 or not args.logit_scale > 0:
        p.error("--tokens, --hidden, --vocab, --chunk and --reps must be at least 1, --logit-scale above 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    h, w, targets = inputs(args.tokens, args.hidden, args.vocab, args.logit_scale, device)
    exact, largest = reference(h, w, targets)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab,
              "chunk": args.chunk, "logit_scale": args.logit_scale,
              "largest_logit": largest,
              "heads": {head: measure(h, w, targets, exact, head_dtype=head, chunk=args.chunk, reps=args.reps)
                        for head in HEADS}}
    text = json.dumps(report, indent=1)
    if args.out is not None:
        atomic_write_json(args.out, report)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
