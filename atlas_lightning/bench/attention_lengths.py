"""What a new sequence length costs the attention kernels: causal SDPA forward + backward at the
8B shape (32 query / 8 key-value heads of 128, bf16) at lengths seen before and at fresh ones, per
backend (cuDNN, flash, memory-efficient), and the varlen API where it takes these heads. CUDA only.

    atlas-lightning bench attention-lengths [--out $OUT/attention-lengths.json]
    python -m atlas_lightning.bench.attention_lengths [--out ...]          # the same

Why it exists: the dense batch update's 17 micro-steps of ~1.43 s of device time (profile) took
33.0 s, ~8 s more than 17 x 1.5 s. cuDNN's SDPA builds an execution graph per (batch, heads,
length), and a batch brings ~30 lengths the warm-up never saw: 80-110 ms each (``bench/NOTES.md``,
run 15), which is why ``model.attention_length_bucket`` pads each sequence to a multiple of 1,024.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from atlas_lightning.store.atomic import atomic_write_text


def step(length: int, backend) -> float:
    q = torch.randn(1, 32, length, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 8, length, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 8, length, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="atlas-lightning bench attention-lengths", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="", help="a JSON file for the timings")
    args = p.parse_args(argv)
    results = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            step(8000, backend)
            seen = [step(8000, backend) for _ in range(3)]
            fresh = [step(8001 + 37 * i, backend) for i in range(6)]
            again = [step(8001 + 37 * i, backend) for i in range(6)]
            results[name] = {"seen_s": seen, "fresh_s": fresh, "fresh_again_s": again}
        except Exception as err:
            results[name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
    try:
        from torch.nn.attention.varlen import varlen_attn

        lengths = [8000, 7739]
        cu = torch.tensor([0, 8000, 15739], device="cuda", dtype=torch.int32)
        q = torch.randn(15739, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(15739, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(15739, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        def run():
            out = varlen_attn(q, k, v, cu, cu, max(lengths), max(lengths), window_size=(-1, 0))
            out.backward(torch.ones_like(out))
            torch.cuda.synchronize()
        run()
        start = time.perf_counter()
        run()
        results["varlen_gqa"] = {"s": time.perf_counter() - start}
    except Exception as err:
        results["varlen_gqa"] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
    for name, r in results.items():
        print(name, json.dumps({k: ([round(x * 1000, 1) for x in v] if isinstance(v, list) else v) for k, v in r.items()}))
    if args.out:
        atomic_write_text(args.out, json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
