"""``out = W + (s * B) @ A`` in one pass over W: a Triton kernel for CUDA, ``torch.addmm`` elsewhere.

Why a kernel: merged-weight sync is memory-bound (a LoRA delta has rank 64, so the GEMM is
tiny next to reading and writing W). The best torch can do is ``torch.addmm(W, B, A, out=dst)``,
and with ``dst`` not W it first copies W into ``dst`` and then runs the GEMM in place: four
passes over the weight where two suffice (measured on the H200, ``bench/NOTES.md``: 252 copies plus 252
GEMMs, 20 ms of device time for the 8B shape's 16.4 GB). Here each program loads a tile of W,
computes that tile of ``B @ A`` (the whole rank in one ``tl.dot``, fp32 accumulation), adds,
rounds once and stores: W is read once and ``out`` written once; A and B are re-read per tile
from L2.

Why groups: one launch per linear left the card waiting on the host (252 launches for the 8B
shape, 50-90 us of Python each against ~38 us of device work). ``merge_lora_many`` launches up
to ``GROUP_SLOTS`` row-major merges at once (a whole 512 MB bucket: 28 launches for the 8B
shape), each merge a slot of the kernel's tuple arguments, so Triton still knows every
pointer's alignment and that the inner strides are 1 (a table of pointers read in the kernel
lost both and ran 3.5x slower, bench/NOTES.md runs 5-6). Every launch is padded to
``GROUP_SLOTS`` slots, so the kernel compiles once per process and specialisation, not once per
number of merges: 7.4 s once on an H100 in an empty cache, where launches of 3, 7, 11 and 16
merges compiled for 14.4 s unpadded (``bench/results/h100-run14-merge-first-launch.log``);
Triton's disk cache serves later runs.

Arithmetic (the same formula as the ``addmm`` fallback): the factors are cast to ``out``'s
dtype after ``B`` is scaled by ``s`` in its own dtype, the product accumulates in fp32, W is
added in fp32 and the sum is rounded once to ``out``'s dtype (``rounding_bound`` states how
far from the exact value that may land). One fixed tile (``TILE``, no autotuning), so every
rank and every run computes the same bits; on CPU the kernel and ``addmm`` differ at most in
the last bit where the accumulation order differs. On the card cuBLAS's bf16 ``addmm`` is not
correctly rounded (100x outside the bound, ``bench/NOTES.md``), which is why CUDA never takes it.

Shapes: ``weight (M, N)``, ``lora_b (M, r)``, ``lora_a (r, N)``, any strides (transposed views
for ``fan_in_fan_out`` included), ``out (M, N)``. Who calls it: ``weights``' merges.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Sequence

import torch
from torch import Tensor

try:  # Triton ships with CUDA builds of torch; CPU builds have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

#: Tile of W each program merges, and its warps. Fixed rather than autotuned: an autotuner
#: times configs on each process's first call (seconds on the first sync) and could pick
#: different tiles on different ranks. Chosen on the H200 (bench/merge_packing.py --tiles).
TILE = {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4}

#: Most merges one launch of the grouped kernel carries (each a slot of its tuple arguments;
#: a 512 MB bucket of the 8B shape holds up to ~11 linears).
GROUP_SLOTS = 16


class MergeJob(NamedTuple):
    """One merge for ``merge_lora_many``: ``out = weight + (scaling * lora_b) @ lora_a``."""

    weight: Tensor
    lora_b: Tensor
    lora_a: Tensor
    scaling: float
    out: Tensor


def kernel_applies(weight: Tensor) -> bool:
    """The Triton path runs for CUDA tensors (or any, under ``TRITON_INTERPRET=1``, for tests)."""
    if triton is None:
        return False
    return weight.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def rounding_bound(weight: Tensor, lora_b: Tensor, lora_a: Tensor, scaling: float) -> tuple[Tensor, Tensor]:
    """``(exact, bound)`` in float64: the exact ``W + (s B).to(dtype) @ A.to(dtype)`` a correct
    merge rounds, and how far from it a result may land: one rounding to W's dtype plus fp32
    accumulation, ``spacing(exact) + (r + 2) * eps32 * (|W| + |s B| @ |A|)``. The reference the
    tests and the card's ``kernel_check`` hold every merge to."""
    b = (lora_b * scaling).to(weight.dtype).double()
    a = lora_a.to(weight.dtype).double()
    w = weight.double()
    exact = w + b @ a
    spacing = torch.finfo(weight.dtype).eps * torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))))
    bound = spacing + (a.shape[0] + 2) * torch.finfo(torch.float32).eps * (w.abs() + b.abs() @ a.abs())
    return exact, bound


if triton is not None:

    @triton.jit
    def _merge_tile(w_ptr, b_ptr, a_ptr, out_ptr, M, N, K, scaling, stride_wm, stride_wn, stride_bm, stride_bk,
                    stride_ak, stride_an, stride_om, stride_on, pid_m, pid_n,
                    BLOCK_K: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
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

    @triton.jit
    def _merge_kernel(w_ptr, b_ptr, a_ptr, out_ptr, M, N, K, scaling,
                      stride_wm, stride_wn, stride_bm, stride_bk, stride_ak, stride_an, stride_om, stride_on,
                      BLOCK_K: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        _merge_tile(w_ptr, b_ptr, a_ptr, out_ptr, M, N, K, scaling, stride_wm, stride_wn, stride_bm, stride_bk,
                    stride_ak, stride_an, stride_om, stride_on, tl.program_id(0), tl.program_id(1),
                    BLOCK_K, IEEE, BLOCK_M, BLOCK_N)

    @triton.jit
    def _row_major_slot(w_ptr, b_ptr, a_ptr, out_ptr, M, N, K, scaling, tile,
                        BLOCK_K: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # row-major W, out (M, N), B (M, K), A (K, N): literal unit strides keep loads vectorised
        tiles_n = tl.cdiv(N, BLOCK_N)
        _merge_tile(w_ptr, b_ptr, a_ptr, out_ptr, M, N, K, scaling, N, 1, K, 1, N, 1, N, 1,
                    tile // tiles_n, tile % tiles_n, BLOCK_K, IEEE, BLOCK_M, BLOCK_N)

    @triton.jit
    def _merge_group_kernel(ws, bs, as_, outs, ms, ns, scalings, K,
                            BLOCK_K: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # one 1-D grid over the slots' tiles, slot after slot (tuples: one slot per merge)
        pid = tl.program_id(0)
        start = 0
        for i in tl.static_range(len(ws)):
            count = tl.cdiv(ms[i], BLOCK_M) * tl.cdiv(ns[i], BLOCK_N)
            if (pid >= start) & (pid < start + count):
                _row_major_slot(ws[i], bs[i], as_[i], outs[i], ms[i], ns[i], K, scalings[i], pid - start,
                                BLOCK_K, IEEE, BLOCK_M, BLOCK_N)
            start = start + count


def _check_chain(weight: Tensor, lora_b: Tensor, lora_a: Tensor) -> None:
    if weight.dim() != 2 or lora_b.shape[0] != weight.shape[0] or lora_a.shape[1] != weight.shape[1] \
            or lora_b.shape[1] != lora_a.shape[0]:
        raise ValueError(f"merge_lora: weight {tuple(weight.shape)}, B {tuple(lora_b.shape)}, A {tuple(lora_a.shape)} "
                         f"do not chain as W + B @ A")


def _tile_arguments(weight: Tensor, rank: int) -> dict:
    tile = dict(TILE) if weight.is_cuda else {"BLOCK_M": 64, "BLOCK_N": 128}  # the interpreter ignores warps
    return {"BLOCK_K": max(16, triton.next_power_of_2(rank)), "IEEE": weight.dtype == torch.float32, **tile}


def merge_lora(weight: Tensor, lora_b: Tensor, lora_a: Tensor, scaling: float, out: Tensor | None = None) -> Tensor:
    """``weight + (scaling * lora_b).to(dtype) @ lora_a.to(dtype)`` rounded once to ``weight``'s
    dtype (module doc), into ``out`` when given (same shape and dtype as ``weight``)."""
    _check_chain(weight, lora_b, lora_a)
    if out is None:
        out = torch.empty_like(weight, memory_format=torch.contiguous_format)
    if not kernel_applies(weight):
        return torch.addmm(weight, (lora_b * scaling).to(weight.dtype), lora_a.to(weight.dtype), out=out)
    M, N = weight.shape
    meta = _tile_arguments(weight, lora_a.shape[0])
    grid = (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]))
    _merge_kernel[grid](weight, lora_b, lora_a, out, M, N, lora_a.shape[0], float(scaling),
                        weight.stride(0), weight.stride(1), lora_b.stride(0), lora_b.stride(1),
                        lora_a.stride(0), lora_a.stride(1), out.stride(0), out.stride(1), **meta)
    return out


def _groupable(job: MergeJob) -> bool:
    return (kernel_applies(job.weight) and job.out.dtype == job.weight.dtype and job.out.shape == job.weight.shape
            and all(t.is_contiguous() for t in job[:3]) and job.out.is_contiguous())


def _slot_arguments(jobs: Sequence[MergeJob]) -> dict:
    """The grouped kernel's tuple arguments for 1..GROUP_SLOTS jobs, always ``GROUP_SLOTS``
    slots long. Triton compiles a kernel once per tuple length, so a launch of every length
    (buckets end with whatever merges are left) would compile up to ``GROUP_SLOTS`` times on a
    fresh machine. An empty slot repeats the first job's tensors (the same alignment, so the
    same specialisation) with zero rows and columns: it owns no tiles and is never read."""
    if not 1 <= len(jobs) <= GROUP_SLOTS:
        raise ValueError(f"a grouped launch carries 1..{GROUP_SLOTS} merges, not {len(jobs)}")
    empty = GROUP_SLOTS - len(jobs)
    first = jobs[0]
    return {"ws": tuple(j.weight for j in jobs) + (first.weight,) * empty,
            "bs": tuple(j.lora_b for j in jobs) + (first.lora_b,) * empty,
            "as_": tuple(j.lora_a for j in jobs) + (first.lora_a,) * empty,
            "outs": tuple(j.out for j in jobs) + (first.out,) * empty,
            "ms": tuple(j.weight.shape[0] for j in jobs) + (0,) * empty,
            "ns": tuple(j.weight.shape[1] for j in jobs) + (0,) * empty,
            "scalings": tuple(float(j.scaling) for j in jobs) + (0.0,) * empty}


def _launch_group(jobs: Sequence[MergeJob]) -> None:
    """One launch of ``_merge_group_kernel`` for 1..GROUP_SLOTS row-major jobs of one rank,
    device and dtype (each job's tensors and sizes a slot of the kernel's tuple arguments)."""
    meta = _tile_arguments(jobs[0].weight, jobs[0].lora_a.shape[0])
    tiles = sum(triton.cdiv(j.weight.shape[0], meta["BLOCK_M"]) * triton.cdiv(j.weight.shape[1], meta["BLOCK_N"])
                for j in jobs)
    _merge_group_kernel[(tiles,)](**_slot_arguments(jobs), K=jobs[0].lora_a.shape[0], **meta)


def merge_lora_many(jobs: Sequence[MergeJob]) -> None:
    """Every job's merge into its ``out`` (same bits as ``merge_lora`` one by one, the same tile
    and formula). On CUDA, contiguous jobs of one rank, device and dtype share launches, up to
    ``GROUP_SLOTS`` a launch; the rest go one by one. The caller keeps the tensors alive until
    the launches are queued (this returns when they are, not when they finish)."""
    groups: dict[tuple, list[MergeJob]] = {}
    for job in jobs:
        _check_chain(job.weight, job.lora_b, job.lora_a)
        if _groupable(job):
            groups.setdefault((job.lora_a.shape[0], job.weight.device, job.weight.dtype), []).append(job)
        else:
            merge_lora(*job)
    for same in groups.values():
        for start in range(0, len(same), GROUP_SLOTS):
            _launch_group(same[start:start + GROUP_SLOTS])
