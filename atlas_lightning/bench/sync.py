"""Weight sync: adapter export, and the merged bucketed path (gather, merge, pack).

* ``adapter_state``: the actor's LoRA tensors, gathered whole (what the LoRA sync sends);
  ``save_adapter``: the same written as a PEFT folder (disk included).
* merged, packed then copied: ``merged_weight_buckets`` (now the packs' views) then ``torch.cat``
  of each bucket's tensors into one buffer (what a packer costs that does not write in place);
* merged, packed in place: ``merged_weight_packs`` (the merge writes into the bucket buffer).

Rates: ``gbps_out`` = merged bytes produced per second; ``gbps_moved`` = the fewest bytes the
job must move through device memory per second (read each base weight, write it packed: 2 x
the merged bytes; the LoRA factors are negligible), to compare with the measured copy
bandwidth (which also counts read + write). Unsharded here (one GPU): gathering is free.
"""

from __future__ import annotations

import tempfile
import time

import torch

from atlas_lightning.models.adapters import save_adapter
from atlas_lightning.models.merge_kernel import GROUP_SLOTS, MergeJob, kernel_applies, merge_lora, merge_lora_many, rounding_bound
from atlas_lightning.models.weights import adapter_state, merged_weight_buckets, merged_weight_packs

from .measure import sync, timed


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def kernel_check(model, adapter: str = "actor", layers: int = 14) -> dict:
    """The merge (``merge_lora``: the Triton kernel on CUDA), the grouped launch
    (``merge_lora_many``) and ``torch.addmm`` of the same formula, each against a float64
    reference (``rounding_bound``), on the first ``layers`` LoRA linears. Errors are in units of
    the allowed bound; <= 1 is correct. Also whether the grouped launch gives the per-linear
    bits, and the share of elements where the kernel and ``addmm`` differ."""
    from atlas_lightning.models.adapter_switch import tuner_layers

    worst = {"merge": 0.0, "grouped": 0.0, "addmm": 0.0}
    differing, total, grouped_equal = 0, 0, True
    chosen = tuner_layers(model.hf_model)[:layers]
    with torch.no_grad():
        for start in range(0, len(chosen), GROUP_SLOTS):
            jobs, singles = [], []
            for layer in chosen[start:start + GROUP_SLOTS]:
                w = layer.get_base_layer().weight
                a, b, s = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight, layer.scaling[adapter]
                jobs.append(MergeJob(w, b, a, s, torch.empty_like(w)))
                singles.append(merge_lora(w, b, a, s))
            merge_lora_many(jobs)
            for job, single in zip(jobs, singles):
                exact, bound = rounding_bound(job.weight, job.lora_b, job.lora_a, job.scaling)
                addmm = torch.addmm(job.weight, (job.lora_b * job.scaling).to(job.weight.dtype), job.lora_a.to(job.weight.dtype))
                for name, got in (("merge", single), ("grouped", job.out), ("addmm", addmm)):
                    worst[name] = max(worst[name], float(((got.double() - exact).abs() / bound).max()))
                grouped_equal &= torch.equal(single, job.out)
                differing += int((single != addmm).sum())
                total += single.numel()
    return {"kernel": kernel_applies(chosen[0].get_base_layer().weight), "merge_error_in_bounds": worst["merge"],
            "grouped_error_in_bounds": worst["grouped"], "grouped_equals_per_linear": grouped_equal,
            "addmm_error_in_bounds": worst["addmm"], "differing_fraction": differing / max(total, 1),
            "linears": len(chosen)}


def measure_weight_sync(model, device: torch.device, bucket_bytes: int, copy_gbps: float | None) -> dict:
    out: dict = {"bucket_bytes": bucket_bytes}
    state = {}
    seconds = timed(device, lambda: state.update(adapter_state(model, "actor")))
    nbytes = sum(_nbytes(t) for t in state.values())
    out["adapter_state"] = {"seconds": seconds, "bytes": nbytes, "gbps": nbytes / seconds / 1e9, "tensors": len(state)}
    state.clear()  # the gathered adapter's memory back before the merge paths run
    with tempfile.TemporaryDirectory() as folder:
        seconds = timed(device, lambda: save_adapter(model, "actor", f"{folder}/actor"))
    out["save_adapter"] = {"seconds": seconds, "gbps": nbytes / seconds / 1e9}

    def cat_path() -> int:
        total = 0
        for bucket in merged_weight_buckets(model, "actor", bucket_bytes):
            packed = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in bucket])
            total += packed.numel()
            del packed
        return total

    def pack_path() -> int:
        total = 0
        for buffer, _ in merged_weight_packs(model, "actor", bucket_bytes):
            total += buffer.numel()
        return total

    for name, fn in (("merged_cat", cat_path), ("merged_packs", pack_path)):
        fn()  # warm-up: allocator and GEMM heuristics
        sizes = []
        times = [timed(device, lambda: sizes.append(fn())) for _ in range(2)]
        seconds = min(times)
        produced = sizes[-1]
        sync(device)
        start = time.perf_counter()
        fn()
        queued = time.perf_counter() - start  # host time until the last launch is queued
        sync(device)
        entry = {"seconds": seconds, "times_s": times, "host_s": queued, "bytes": produced,
                 "gbps_out": produced / seconds / 1e9, "gbps_moved": 2 * produced / seconds / 1e9}
        if copy_gbps:
            entry["fraction_of_copy_bandwidth"] = entry["gbps_moved"] / copy_gbps
        out[name] = entry
    out["kernel_check"] = kernel_check(model)
    return out
