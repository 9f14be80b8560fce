"""The fused memory-bound kernels (``model.elementwise_kernels``: RMSNorm, SwiGLU + LoRA down,
rotary) against the torch ops they replace, at the 8B shape's per-layer sizes (16,384 tokens,
hidden 4,096, 32 query / 8 key-value heads of 128, MLP width 12,288), forward + backward, CUDA
events (``triton.testing.do_bench``, median). CUDA and Triton only.

    atlas-lightning bench elementwise-kernels [--tokens 16384] [--out $OUT/elementwise-kernels.json]
    python -m atlas_lightning.bench.elementwise_kernels [...]          # the same

Prints one row a kernel: torch ms, fused ms, the bytes a single pass must move and the
fused kernel's share of the copy bandwidth that implies (``bench/NOTES.md``, run 15).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from atlas_lightning.store.atomic import atomic_write_text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="atlas-lightning bench elementwise-kernels", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--out", default="", help="a JSON file for the rows")
    args = p.parse_args(argv)
    from triton.testing import do_bench

    from atlas_lightning.models.fused_kernels import apply_rotary, rms_norm, torch_rotary_reference
    from atlas_lightning.models.lean_activations import RMSNormFunction
    from atlas_lightning.models.recompute import SwiGLUDownFunction

    T, H, NQ, NK, D, I = args.tokens, 4096, 32, 8, 128, 12288  # noqa: E741 (I: the MLP's intermediate size)
    dev = "cuda"
    rows = []

    def bench(name, make_and_run, bytes_moved):
        times = {}
        for kind in ("torch", "fused"):
            fn = make_and_run(kind)
            fn()
            times[kind] = do_bench(fn, warmup=25, rep=100, return_mode="median")
        rows.append({"kernel": name, "torch_ms": times["torch"], "fused_ms": times["fused"],
                     "gb_one_pass": bytes_moved / 1e9, "fused_tb_s": bytes_moved / times["fused"] / 1e9})

    for label, shape in (("rmsnorm hidden", (T, H)), ("q_norm", (T, NQ, D)), ("k_norm", (T, NK, D))):
        x = torch.randn(shape, device=dev).bfloat16().requires_grad_(True)
        w = (1 + 0.1 * torch.randn(shape[-1], device=dev)).bfloat16()
        gy = torch.randn(shape, device=dev).bfloat16()

        def make(kind, x=x, w=w, gy=gy):
            f = (lambda: RMSNormFunction.apply(x, w, 1e-6, False)) if kind == "torch" else (lambda: rms_norm(x, w, 1e-6, False))
            return lambda: torch.autograd.grad(f(), x, gy)
        n = x.numel() * 2
        bench(f"{label} fwd+bwd", make, n * 2 + n * 3)  # fwd: x in, y out; bwd: x, dy in, dx out

    gate = torch.randn(T, I, device=dev).bfloat16()
    up = torch.randn(T, I, device=dev).bfloat16()
    w = (torch.randn(H, I, device=dev) / 100).bfloat16()
    a = (torch.randn(64, I, device=dev) / 100).requires_grad_(True)
    b = (torch.randn(H, 64, device=dev) / 100).requires_grad_(True)
    gy = torch.randn(T, H, device=dev).bfloat16()

    def make_swiglu(kind):
        fused = kind == "fused"

        def run():
            g, u = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
            y = SwiGLUDownFunction.apply(g, u, w, a, b, 2.0, fused)
            torch.autograd.grad(y, [g, u, a, b], gy)
        return run
    bench("swiglu+down (LoRA) fwd+bwd, GEMMs incl.", make_swiglu, gate.numel() * 2 * 8)

    q = torch.randn(1, T, NQ, D, device=dev).bfloat16().transpose(1, 2)
    k = torch.randn(1, T, NK, D, device=dev).bfloat16().transpose(1, 2)
    freqs = torch.arange(T, device=dev).float()[:, None] / 1e6 ** (torch.arange(64, device=dev).float() / 64)
    emb = torch.cat((freqs, freqs), -1)[None]
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()

    def make_rope(kind):
        fn = torch_rotary_reference if kind == "torch" else apply_rotary

        def run():
            qi, ki = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
            outs = fn(qi * 1, ki * 1, cos, sin)
            torch.autograd.grad(outs, [qi, ki], [torch.ones_like(outs[0]), torch.ones_like(outs[1])])
        return run
    bench("rotary q+k fwd+bwd (incl. 2 clones, 2 muls)", make_rope, (q.numel() + k.numel()) * 2 * 4)

    print(f"{'kernel':45s} {'torch ms':>9s} {'fused ms':>9s} {'speedup':>8s} {'GB 1-pass':>9s} {'TB/s':>6s}")
    for r in rows:
        print(f"{r['kernel']:45s} {r['torch_ms']:9.3f} {r['fused_ms']:9.3f} {r['torch_ms'] / r['fused_ms']:8.2f} "
              f"{r['gb_one_pass']:9.3f} {r['fused_tb_s']:6.2f}")
    if args.out:
        atomic_write_text(args.out, json.dumps({"tokens": T, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
