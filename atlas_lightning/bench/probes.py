"""Where an update's time goes, and whether fla re-tunes: probes the benchmark runs on our path.

* ``profile_micro_step``: ``torch.profiler`` over one actor micro-step (forward + backward) of a
  runner; the device time of every kernel, summed by category (``CATEGORIES``: GEMMs, the
  attention kernels, fla's Gated DeltaNet kernels, its conv, norms, element-wise and copies),
  and the top kernels by name. Profiling first is what chooses the next change (``bench/NOTES.md``).
* ``profile_call``: the same over any call, with the card's idle share of its wall: the update
  benchmark's whole update (section ``update-profile``) and ``fit``'s (the step benchmark's
  ``profile_update_step``), so that the two are compared kernel by kernel and gap by gap.
* ``autotune_probe``: one actor micro-step on a micro-batch of a NEW length (the update's
  sequences less the last one) after the update ran: its seconds, and how many autotune entries
  fla's kernels added (``models/fla_tuning.tuned_entries``): 0 when no length re-tunes.
* ``fla_configs``: the config each fla autotuner chose, per key (what a pinned table would hold).

Who calls it: ``update_bench.py``, ``step.py`` (``profile_call``). CUDA only: on CPU they return
``{"skipped": ...}``, and ``profile_call`` is called on CUDA alone.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from typing import Callable, TypeVar

import torch

T = TypeVar("T")

#: Kernel-name patterns, first match wins (lower-case names).
CATEGORIES = (
    ("gemm", r"gemm|cutlass|sm90_xmma|nvjet|matmul|cublas"),
    ("attention (flash)", r"flash|fmha|attention"),
    ("gated delta rule (fla)", r"chunk|delta|wy_|solve_tril|merge_16x16|kkt|fwd_h|bwd_dhu|dqkwg|recompute_w_u|cumsum"),
    ("causal conv1d", r"conv"),
    ("norms", r"norm|rsqrt"),
    ("softmax / log-probs", r"softmax|logsumexp|nll|log_"),
    ("copies", r"copy|memcpy|memset|cat|index|gather|scatter|fill"),
    ("element-wise", r"elementwise|vectorized|unrolled|reduce|silu|sigmoid|mul|add|exp"),
)


def _category(name: str) -> str:
    lower = name.lower()
    for label, pattern in CATEGORIES:
        if re.search(pattern, lower):
            return label
    return "other"


def actor_micro_step(runner, inputs, indices) -> None:
    """Forward + backward of the actor on the sequences ``indices`` (as ``update.OursRunner``)."""
    from .update import TEMPERATURE, _losses, _pack

    runner.use_recompute_for(inputs, indices)  # the micro-batch's own plan, as in the update
    packed = _pack(inputs, indices, runner.device)
    rows = torch.as_tensor(indices, device=runner.device)
    out, _ = runner.model.actor_forward(packed, temperature=TEMPERATURE, compute_entropy=False)
    _losses("actor", inputs, rows, packed, out, float(inputs.response_mask.sum())).backward()


def profile_micro_step(runner, inputs, indices=None, top: int = 20) -> dict:
    """(module doc) ``indices``: the micro-batch's sequences (default: all of ``inputs``)."""
    if runner.device.type != "cuda":
        return {"skipped": "CPU"}
    indices = list(range(len(inputs.sequences))) if indices is None else list(indices)
    runner.zero_grad()
    _, summary = profile_call(lambda: actor_micro_step(runner, inputs, indices), top=top, host_ops=True)
    runner.zero_grad()
    return summary


def profile_call(fn: Callable[[], T], top: int = 20, host_ops: bool = False) -> tuple[T, dict]:
    """``fn()`` under ``torch.profiler`` on CUDA: its result and where the card's time went.
    ``wall_s_under_profiler`` (synchronised before and after), ``device_s`` (every kernel's
    seconds, summed), ``idle_share`` (``1 - device_s / wall``: the card waiting on the host, its
    launches and reads; kernels on several streams at once would make it negative), the caching
    allocator's retries and driver calls meanwhile, by category and the ``top`` kernels.
    ``host_ops``: record the host's operators too (more overhead on the host: off where the idle
    share is the question). Its own processing takes tens of seconds over a whole update's
    kernels (about 100,000 for the 8B): a step that profiles needs that much more time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    with profile(activities=[ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if host_ops else [])) as prof:
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    after = torch.cuda.memory_stats()
    by_kernel: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "self_cuda_time_total", 0.0)
        if device_us and event.device_type == torch.autograd.DeviceType.CUDA:
            by_kernel[event.key] += device_us / 1e6
    by_category: dict[str, float] = defaultdict(float)
    for name, seconds in by_kernel.items():
        by_category[_category(name)] += seconds
    total = sum(by_kernel.values())
    return result, {
        "wall_s_under_profiler": wall, "device_s": total, "idle_share": 1.0 - total / wall if wall else None,
        # the caching allocator's trips to the driver meanwhile (each cudaFree waits on the card)
        "allocator": {key: after.get(key, 0) - before.get(key, 0)
                      for key in ("num_alloc_retries", "num_device_alloc", "num_device_free")},
        "categories": {k: {"s": v, "share": v / total if total else 0.0}
                       for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": k[:120], "s": v, "category": _category(k)}
                        for k, v in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:top]],
    }


def autotune_probe(runner, inputs) -> dict:
    if runner.device.type != "cuda":
        return {"skipped": "CPU"}
    from atlas_lightning.models.fla_tuning import tuned_entries

    indices = list(range(len(inputs.sequences) - 1)) or [0]
    tokens = sum(int(inputs.sequences[i].numel()) for i in indices)
    before = tuned_entries()
    runner.zero_grad()
    torch.cuda.synchronize()
    start = time.perf_counter()
    actor_micro_step(runner, inputs, indices)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    runner.zero_grad()
    return {"tokens": tokens, "actor_micro_step_s": seconds, "tuned_entries_before": before,
            "new_tuned_entries": tuned_entries() - before}


def fla_configs() -> dict:
    """``{kernel: {key: config}}`` of every fla autotuner that has tuned something."""
    from atlas_lightning.models.fla_tuning import autotuners

    out: dict = {}
    try:
        for name, tuner in autotuners():
            if tuner.cache:
                out[name] = {str(key): {"kwargs": dict(config.kwargs), "num_warps": config.num_warps,
                                        "num_stages": config.num_stages} for key, config in tuner.cache.items()}
    except ImportError as err:  # no Triton here
        return {"skipped": str(err)}
    return out
