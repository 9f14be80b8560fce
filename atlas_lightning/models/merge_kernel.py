"""``out = W + (s * B) @ A`` in one pass over W: a Triton kernel for CUDA, ``torch.addmm`` elsewhere.

Why a kernel: merged-weight sync is memory-bound (a LoRA delta has rank 64, so the GEMM is
tiny next to reading and writing W). The best torch can do is ``torch.addmm(W, B, A, out=dst)``,
and with ``dst`` not W it first copies W into ``dst`` and then runs the GEMM in place: four
passes over the weight where two suffice (measured on the H200 in issue 9: 252 copies plus 252
GEMMs, 20 ms of device time for the 8B shape's 16.4 GB). Here each program loads a tile of W,
computes that tile of ``B @ A`` (the whole rank in one ``tl.dot``, fp32 accumulation), adds,
rounds once and stores: W is read once and ``out`` written once; A and B are re-read per tile
from L2.

Arithmetic (the same formula as ``weights._merge_into``'s fallback): the factors are cast to
``out``'s dtype after ``B`` is scaled by ``s`` in its own dtype, the product accumulates in fp32,
W is added in fp32 and the sum is rounded once to ``out``'s dtype. The kernel and the fallback
may differ in the last bit where fp32 accumulation order differs; each is deterministic, so a
sharded and an unsharded model on the same device give the same bits.

Shapes: ``weight (M, N)``, ``lora_b (M, r)``, ``lora_a (r, N)``, any strides (transposed views
for ``fan_in_fan_out`` included), ``out (M, N)``. Who calls it: ``weights._merge_into``.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:  # Triton ships with CUDA builds of torch; CPU builds have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def kernel_applies(weight: Tensor) -> bool:
    """The Triton path runs for CUDA tensors (or any, under ``TRITON_INTERPRET=1``, for tests)."""
    if triton is None:
        return False
    return weight.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.autotune(
        configs=[
            triton.Config({"BLOCK_M": 64, "BLOCK_N": 256}, num_warps=8),
            triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8),
            triton.Config({"BLOCK_M": 128, "BLOCK_N": 256}, num_warps=8),
            triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=4),
        ],
        key=["M", "N", "BLOCK_K"],
    )
    @triton.jit
    def _merge_kernel(w_ptr, b_ptr, a_ptr, out_ptr, M, N, K, scaling,
                      stride_wm, stride_wn, stride_bm, stride_bk, stride_ak, stride_an, stride_om, stride_on,
                      BLOCK_K: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        mask_m, mask_n, mask_k = rm < M, rn < N, rk < K
        out_dtype = out_ptr.dtype.element_ty
        b = tl.load(b_ptr + rm[:, None] * stride_bm + rk[None, :] * stride_bk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        a = tl.load(a_ptr + rk[:, None] * stride_ak + rn[None, :] * stride_an,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        b = (b * scaling).to(out_dtype)
        a = a.to(out_dtype)
        if IEEE:
            delta = tl.dot(b, a, input_precision="ieee", out_dtype=tl.float32)
        else:
            delta = tl.dot(b, a, out_dtype=tl.float32)
        mask = mask_m[:, None] & mask_n[None, :]
        w = tl.load(w_ptr + rm[:, None] * stride_wm + rn[None, :] * stride_wn, mask=mask, other=0.0)
        result = (w.to(tl.float32) + delta).to(out_dtype)
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on, result, mask=mask)


def merge_lora(weight: Tensor, lora_b: Tensor, lora_a: Tensor, scaling: float, out: Tensor | None = None) -> Tensor:
    """``weight + (scaling * lora_b).to(dtype) @ lora_a.to(dtype)`` rounded once to ``weight``'s
    dtype (module doc), into ``out`` when given (same shape and dtype as ``weight``)."""
    if weight.dim() != 2 or lora_b.shape[0] != weight.shape[0] or lora_a.shape[1] != weight.shape[1] \
            or lora_b.shape[1] != lora_a.shape[0]:
        raise ValueError(f"merge_lora: weight {tuple(weight.shape)}, B {tuple(lora_b.shape)}, A {tuple(lora_a.shape)} "
                         f"do not chain as W + B @ A")
    if out is None:
        out = torch.empty_like(weight, memory_format=torch.contiguous_format)
    if not kernel_applies(weight):
        return torch.addmm(weight, (lora_b * scaling).to(weight.dtype), lora_a.to(weight.dtype), out=out)
    M, N = weight.shape
    K = lora_a.shape[0]
    block_k = max(16, triton.next_power_of_2(K))

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]))

    args = (weight, lora_b, lora_a, out, M, N, K, float(scaling), weight.stride(0), weight.stride(1),
            lora_b.stride(0), lora_b.stride(1), lora_a.stride(0), lora_a.stride(1), out.stride(0), out.stride(1))
    if weight.is_cuda:
        _merge_kernel[grid](*args, BLOCK_K=block_k, IEEE=weight.dtype == torch.float32)
    else:  # Triton's CPU interpreter (tests) has no benchmarker for the autotuner: one fixed tile
        _merge_kernel.fn[grid](*args, BLOCK_K=block_k, IEEE=weight.dtype == torch.float32, BLOCK_M=64, BLOCK_N=128)
    return out
