"""Clocks, memory peaks and the two ceilings (bf16 matmul rate, device copy bandwidth).

Times are wall-clock seconds between device synchronisations (the measured regions run for
seconds, so event-level resolution is not needed). Memory is the allocator's peak
(``max_memory_allocated``) in GiB. On CPU (``--tiny``) peaks are reported as ``None``.
"""

from __future__ import annotations

import gc
import statistics
import time
from contextlib import contextmanager
from typing import Callable, Optional

import torch

GIB = 2.0**30


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Before a section on a GPU: collect cyclic garbage and return cached blocks, so its peak is its
    own. On CPU no peak is read, and a full collection costs seconds in a large process: skipped."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> Optional[float]:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def allocated_gib(device: torch.device) -> Optional[float]:
    return torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else None


def timed(device: torch.device, fn: Callable[[], object]) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def repeat(device: torch.device, fn: Callable[[], object], reps: int, warmup: int = 1) -> dict:
    """``warmup`` untimed calls then ``reps`` timed ones: ``{"times_s", "median_s", "warmup_s",
    "peak_gib"}`` (peak over the timed calls)."""
    warm = [timed(device, fn) for _ in range(warmup)]
    reset_peak(device)
    times = [timed(device, fn) for _ in range(reps)]
    return {"times_s": times, "median_s": statistics.median(times), "warmup_s": warm, "peak_gib": peak_gib(device)}


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def matmul_peak(device: torch.device, n: int = 8192, reps: int = 20) -> dict:
    """bf16 ``n x n x n`` matmul rate on random data (fresh inputs, median of ``reps``), TFLOP/s."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(3):
        torch.mm(a, b, out=c)
    times = []
    for _ in range(reps):
        times.append(timed(device, lambda: torch.mm(a, b, out=c)))
    median = statistics.median(times)
    return {"n": n, "dtype": str(dtype), "median_s": median, "tflops": 2.0 * n**3 / median / 1e12}


def copy_bandwidth(device: torch.device, nbytes: int = 4 * 2**30, reps: int = 10) -> dict:
    """Device-to-device copy rate, bytes read plus written, GB/s (1e9)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    times = [timed(device, lambda: dst.copy_(src)) for _ in range(reps)]
    median = statistics.median(times)
    return {"bytes": nbytes, "median_s": median, "gbps": 2.0 * nbytes / median / 1e9}


@contextmanager
def section(results: dict, name: str, device: torch.device):
    """Record an exception (OOM or other) under ``results[name]["error"]`` and carry on."""
    entry = results.setdefault(name, {})
    try:
        yield entry
    except Exception as err:  # a failed measurement must not lose the others
        entry["error"] = f"{'OOM' if is_oom(err) else type(err).__name__}: {str(err)[:400]}"
        print(f"[bench] {name}: {entry['error']}", flush=True)
    finally:
        free_memory(device)
