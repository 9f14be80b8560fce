"""Where an update's time goes, and whether fla re-tunes: probes the benchmark runs on our path.

* ``profile_micro_step``: ``torch.profiler`` over one actor micro-step (forward + backward) of a
  runner; the device time of every kernel, summed by category (``CATEGORIES``: GEMMs, the
  attention kernels, fla's Gated DeltaNet kernels, its conv, norms, element-wise and copies),
  and the top kernels by name. Profiling first is what chooses the next change (``bench/NOTES.md``).
* ``autotune_probe``: one actor micro-step on a micro-batch of a NEW length (the update's
  sequences less the last one) after the update ran: its seconds, and how many autotune entries
  fla's kernels added (``models/fla_tuning.tuned_entries``): 0 when no length re-tunes.
* ``fla_configs``: the config each fla autotuner chose, per key (what a pinned table would hold).

Who calls it: ``update_bench.py``. CUDA only (on CPU they return ``{"skipped": ...}``).
"""

from __future__ import annotations

import re
import time
from collections import defaultdict

import torch

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
    from torch.profiler import ProfilerActivity, profile

    indices = list(range(len(inputs.sequences))) if indices is None else list(indices)
    runner.zero_grad()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        actor_micro_step(runner, inputs, indices)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    runner.zero_grad()
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
    return {
        "wall_s_under_profiler": wall, "device_s": total,
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
