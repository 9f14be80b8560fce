"""What the exact weight-sync digests cost: the first digest (sha256 per tensor, threads over
tensors, device tensors copied to the host first: ``sha256_digest`` below) and the one
``rollout/digest.py`` computes now (``tensor_digest``: an integer fingerprint on the tensor's own
device). CUDA only.

    atlas-lightning bench digest-cost > digest-cost.json        # on the card (bench/results/digest-cost-h200.json)
    python -m atlas_lightning.bench.digest_cost                              # the same

Measures sha256 of host memory (one thread, 16 threads: what checkpoint verification runs per
file), a 27B-class actor adapter digested as written and as vLLM holds it (bf16, B scaled),
and the 8B shape's merged weights (16.4 GB of bf16 in 252 tensors) digested from the GPU.
Seen on the H200 machine (16 cores): sha256 1.26 GB/s a thread, 15.4 GB/s on 16; adapter of
299M fp32 values 0.41 s as written, 1.14 s as held; merged 16.4 GB 12 s (the device-to-host
copies dominate), which is why the nccl transfer, which reports nothing back, digests nothing.
In the RL step the merged sync digested one tensor at a time on both sides: 55 s of a 179 s step
(``bench/results/step-h200-run2-b-merged.*``). ``fingerprint_*``: the current digest, not yet run
on the card.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

THREADS = 16
#: 256 MiB of host memory, hashed once on one thread and once on each of THREADS
HOST_BYTES = 256 << 20


def sha256_digest(t: torch.Tensor) -> str:
    """The first digest of a tensor: sha256 of its dtype, shape and bytes, copied to the host."""
    f = t.detach().contiguous().reshape(-1)
    f = f.cpu() if f.device.type != "cpu" else f
    d = hashlib.sha256(f"{f.dtype}{tuple(t.shape)}".encode())
    d.update(f.view(torch.uint8).numpy())
    return d.hexdigest()


def digest_all(tensors: list[torch.Tensor]) -> list[str]:
    with ThreadPoolExecutor(max_workers=THREADS) as pool:
        return list(pool.map(sha256_digest, tensors))


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def host_sha256() -> dict:
    """sha256 rate of host memory, GB/s: one thread, then THREADS threads on one buffer each."""
    buffer = os.urandom(HOST_BYTES)
    gb = HOST_BYTES / 1e9
    start = time.perf_counter()
    hashlib.sha256(buffer).hexdigest()
    out = {"sha256_1thread_GBps": gb / (time.perf_counter() - start)}
    with ThreadPoolExecutor(max_workers=THREADS) as pool:
        start = time.perf_counter()
        list(pool.map(lambda x: hashlib.sha256(x).hexdigest(), [buffer] * THREADS))
        out[f"sha256_{THREADS}threads_GBps"] = THREADS * gb / (time.perf_counter() - start)
    return out


def adapter_digests() -> dict:
    """An actor adapter of 64 layers x 15 pairs at r64 (299M fp32 values; the 27B's is 467M), digested
    as written (fp32 on the GPU) and as the engine holds it (bf16 on the host, B scaled)."""
    pairs = [(torch.randn(64, 2432, device="cuda"), torch.randn(2432, 64, device="cuda")) for _ in range(64 * 3 * 5)]
    out = {"adapter_values": sum(a.numel() + b.numel() for a, b in pairs)}
    out["adapter_as_written_s"] = timed(lambda: digest_all([t for pair in pairs for t in pair]))

    def as_held() -> list[str]:
        held = []
        for a, b in pairs:
            a_held = a.to("cpu", torch.bfloat16)
            b_held = b.to("cpu", torch.bfloat16)
            b_held *= 2.0
            held += [a_held, b_held]
        return digest_all(held)

    out["adapter_as_held_bf16_s"] = timed(as_held)
    return out


def merged_digests() -> dict:
    """The 8B shape's merged weights (16.4 GB of bf16 in 252 tensors on the GPU): sha256 digests,
    then the current fingerprint (``rollout/digest.tensor_digest``), each twice."""
    from atlas_lightning.rollout.digest import tensor_digest

    weights = [torch.empty(int(16.4e9 / 2 / 252), dtype=torch.bfloat16, device="cuda").normal_() for _ in range(252)]
    out = {"merged_GB": sum(w.numel() * 2 for w in weights) / 1e9}
    out["merged_digest_s"] = timed(lambda: digest_all(weights))
    out["merged_digest_again_s"] = timed(lambda: digest_all(weights))
    out["fingerprint_merged_s"] = timed(lambda: [tensor_digest(w) for w in weights])
    out["fingerprint_merged_again_s"] = timed(lambda: [tensor_digest(w) for w in weights])
    return out


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="atlas-lightning bench digest-cost", description=__doc__.splitlines()[0],
                            epilog="The figures go to stdout as JSON.").parse_args(argv)
    results = host_sha256()
    results.update(adapter_digests())  # the adapter's memory is back before the merged weights are made
    results.update(merged_digests())
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
