"""What the exact weight-sync digests cost: the first digest (sha256 per tensor, threads over
tensors, device tensors copied to the host first: ``h`` below) and the one ``rollout/digest.py``
computes now (``tensor_digest``: an integer fingerprint on the tensor's own device):

    PYTHONPATH=. python bench/digest_cost.py > bench/results/digest-cost-h200.json     # on the H200 machine

Measures sha256 of host memory (one thread, 16 threads: what checkpoint verification runs per
file), a 27B-class actor adapter digested as written and as vLLM holds it (bf16, B scaled),
and the 8B shape's merged weights (16.4 GB of bf16 in 252 tensors) digested from the GPU.
Seen on the H200 machine (16 cores): sha256 1.26 GB/s a thread, 15.4 GB/s on 16; adapter of
299M fp32 values 0.41 s as written, 1.14 s as held; merged 16.4 GB 12 s (the device-to-host
copies dominate), which is why the nccl transfer, which reports nothing back, digests nothing.
In the RL step the merged sync digested one tensor at a time on both sides: 55 s of a 179 s step
(``bench/results/step-h200-run2-b-merged.*``). ``fingerprint_*``: the current digest, not yet
run on the card.
"""
import hashlib, os, time, json, torch
from concurrent.futures import ThreadPoolExecutor as P


def h(t):
    f = t.detach().contiguous().reshape(-1)
    f = f.cpu() if f.device.type != 'cpu' else f
    d = hashlib.sha256(f"{f.dtype}{tuple(t.shape)}".encode())
    d.update(f.view(torch.uint8).numpy())
    return d.hexdigest()


def dig(ts):
    with P(max_workers=16) as p:
        return list(p.map(h, ts))


def T(fn):
    torch.cuda.synchronize()
    s = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - s


r = {}
b = os.urandom(256 << 20)
s = time.perf_counter()
hashlib.sha256(b).hexdigest()
r['sha256_1thread_GBps'] = 0.268 / (time.perf_counter() - s)
with P(max_workers=16) as p:
    s = time.perf_counter()
    list(p.map(lambda x: hashlib.sha256(x).hexdigest(), [b] * 16))
    r['sha256_16threads_GBps'] = 16 * 0.268 / (time.perf_counter() - s)
# an actor adapter of 64 layers x 15 pairs at r64 (299M fp32 values; the 27B's is 467M)
A = [(torch.randn(64, 2432, device='cuda'), torch.randn(2432, 64, device='cuda')) for _ in range(64 * 3 * 5)]
r['adapter_values'] = sum(a.numel() + c.numel() for a, c in A)
r['adapter_as_written_s'] = T(lambda: dig([t for p in A for t in p]))


def held():
    out = []
    for a, c in A:
        a2 = a.to('cpu', torch.bfloat16)
        c2 = c.to('cpu', torch.bfloat16)
        c2 *= 2.0
        out += [a2, c2]
    return dig(out)


r['adapter_as_held_bf16_s'] = T(held)
A = None  # the adapter's memory back before the merged weights are made
# 8B merged: 16.4 GB bf16 in 252 tensors
W = [torch.empty(int(16.4e9 / 2 / 252), dtype=torch.bfloat16, device='cuda').normal_() for _ in range(252)]
r['merged_GB'] = sum(w.numel() * 2 for w in W) / 1e9
r['merged_digest_s'] = T(lambda: dig(W))
r['merged_digest_again_s'] = T(lambda: dig(W))
try:
    from atlas_lightning.rollout.digest import tensor_digest

    r['fingerprint_merged_s'] = T(lambda: [tensor_digest(w) for w in W])
    r['fingerprint_merged_again_s'] = T(lambda: [tensor_digest(w) for w in W])
except ImportError as err:  # run outside the repository root
    r['fingerprint_merged_s'] = f"not measured: {err}"
print(json.dumps(r, indent=1))
