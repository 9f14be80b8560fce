"""The merge kernel (``models/merge_kernel.py``): ``W + (s B) @ A`` rounded once, for square,
wide, tall and transposed weights, ranks below Triton's smallest dot, fp32 and bf16.

The Triton path runs where Triton does: on a CUDA machine, or on CPU under Triton's interpreter
(``TRITON_INTERPRET=1``, set before Triton is imported, hence the subprocess). Without Triton
the fallback (``torch.addmm``) is checked alone. The interpreter runs fp32 only (the
interpreters of Triton 3.5 and 3.6 misread bf16 loads: values of 1e9 where the card computes
correctly); the H200 benchmark checks the kernel and the grouped launch in bf16 on the card
against a float64 reference (``bench/sync.kernel_check``). Grouped launches (``merge_lora_many``)
must give each merge ``merge_lora``'s bits."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from atlas_lightning.models.merge_kernel import GROUP_SLOTS, MergeJob, _slot_arguments, merge_lora, merge_lora_many, rounding_bound

CASES = [((48, 80), 5), ((130, 70), 16), ((64, 64), 64), ((17, 300), 8)]


def _check(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    for (m, n), r in CASES:
        w = (torch.randn(m, n, generator=g) * 0.05).to(dtype)
        b, a = torch.randn(m, r, generator=g) * 0.1, torch.randn(r, n, generator=g) * 0.1
        exact, bound = rounding_bound(w, b, a, 2.0)
        got = merge_lora(w, b, a, 2.0)
        assert got.dtype == dtype and got.shape == w.shape
        assert bool(((got.double() - exact).abs() <= bound).all()), ((m, n), r, float((got.double() - exact).abs().max()))
        # into a strided destination (a transposed view), as fan_in_fan_out layers need
        dst = torch.empty(n, m, dtype=dtype).T
        merge_lora(w, b, a, 2.0, out=dst)
        assert torch.equal(dst, got)
        # transposed inputs
        got_t = merge_lora(w.T.contiguous().T, b, a.T.contiguous().T, 2.0)
        assert torch.equal(got_t, got)


def _check_grouped(dtype: torch.dtype) -> None:
    """``merge_lora_many`` over more jobs than one launch carries (two ranks, so two groups;
    one transposed job, which goes alone) gives each job ``merge_lora``'s bits."""
    g = torch.Generator().manual_seed(1)
    shapes = [(48, 80, 8), (130, 70, 8), (64, 64, 8), (17, 300, 8), (33, 96, 8), (40, 48, 16), (96, 40, 16)]
    shapes += [(16 + 8 * i, 32 + 16 * (i % 3), 8) for i in range(GROUP_SLOTS)]
    jobs, expected = [], []
    for m, n, r in shapes:
        w = (torch.randn(m, n, generator=g) * 0.05).to(dtype)
        b, a = torch.randn(m, r, generator=g) * 0.1, torch.randn(r, n, generator=g) * 0.1
        jobs.append(MergeJob(w, b, a, 1.5, torch.full_like(w, float("nan"))))
        expected.append(merge_lora(w, b, a, 1.5))
    w = jobs[0].weight
    jobs.append(MergeJob(w, jobs[0].lora_b, jobs[0].lora_a, 1.5, torch.full((w.shape[1], w.shape[0]), float("nan"), dtype=dtype).T))
    expected.append(expected[0])
    assert len([s for s in shapes if s[2] == 8]) > GROUP_SLOTS
    merge_lora_many(jobs)
    for job, want in zip(jobs, expected):
        assert torch.equal(job.out, want), tuple(job.weight.shape)


def test_fallback_is_the_rounded_sum():
    for dtype in (torch.float32, torch.bfloat16):
        _check(dtype)
        _check_grouped(dtype)


def test_every_grouped_launch_has_one_tuple_length():
    """Triton compiles once per tuple length: a launch of 3 merges is padded to ``GROUP_SLOTS``
    slots, the empty ones the first job's tensors with no rows or columns (no tiles)."""
    jobs = [MergeJob(torch.zeros(32 * (i + 1), 48), torch.zeros(32 * (i + 1), 4), torch.zeros(4, 48), 0.5 + i,
                     torch.zeros(32 * (i + 1), 48)) for i in range(3)]
    slots = _slot_arguments(jobs)
    assert {len(v) for v in slots.values()} == {GROUP_SLOTS}
    assert slots["ms"] == (32, 64, 96) + (0,) * (GROUP_SLOTS - 3) and slots["ns"][:3] == (48, 48, 48)
    assert set(slots["ns"][3:]) == {0} and slots["scalings"][:3] == (0.5, 1.5, 2.5)
    assert all(t is jobs[0].weight for t in slots["ws"][3:]) and all(t is jobs[0].out for t in slots["outs"][3:])
    full = _slot_arguments(jobs * (GROUP_SLOTS // 3) + jobs[:GROUP_SLOTS % 3])
    assert 0 not in full["ms"]
    for count in (0, GROUP_SLOTS + 1):
        with pytest.raises(ValueError, match="carries"):
            _slot_arguments((jobs * GROUP_SLOTS)[:count])


def test_shapes_that_do_not_chain_are_refused():
    with pytest.raises(ValueError, match="do not chain"):
        merge_lora(torch.zeros(4, 6), torch.zeros(4, 2), torch.zeros(3, 6), 1.0)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (CPU builds of torch)")
def test_triton_kernel_under_the_interpreter():
    code = ("import torch, tests.models.test_merge_kernel as t, atlas_lightning.models.merge_kernel as k;"
            "assert k.kernel_applies(torch.zeros(1));"
            "t._check(torch.float32); t._check_grouped(torch.float32); print('ok')")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout[-2000:] + result.stderr[-4000:]

