"""Weight sync: adapter export, and the merged bucketed path (gather, merge, pack).

* ``adapter_state``: the actor's LoRA tensors, gathered whole (what the LoRA sync sends);
  ``save_adapter``: the same written as a PEFT folder (disk included).
* merged, as shipped before issue 9: ``merged_weight_buckets`` then ``torch.cat`` of each
  bucket's flattened tensors into one buffer (the pack a one-shot transfer needs);
* merged, packed in place: ``merged_weight_packs`` (the merge writes into the bucket buffer).

Rates: ``gbps_out`` = merged bytes produced per second; ``gbps_moved`` = the fewest bytes the
job must move through device memory per second (read each base weight, write it packed: 2 x
the merged bytes; the LoRA factors are negligible), to compare with the measured copy
bandwidth (which also counts read + write). Unsharded here (one GPU): gathering is free.
"""

from __future__ import annotations

import tempfile

import torch

from atlas_lightning.models.adapters import save_adapter
from atlas_lightning.models.merge_kernel import kernel_applies, merge_lora
from atlas_lightning.models.weights import adapter_state, merged_weight_buckets, merged_weight_packs

from .measure import timed


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def kernel_check(model, adapter: str = "actor", layers: int = 14) -> dict:
    """The merge (``merge_lora``: the Triton kernel on CUDA) and ``torch.addmm`` of the same
    formula, each against a float64 reference, on the first ``layers`` LoRA linears. Errors are
    in units of the allowed bound: one rounding to W's dtype plus fp32 accumulation,
    ``spacing(ref) + (r + 2) * eps32 * (|W| + |s B| @ |A|)``; <= 1 is correct. Also the share of
    elements where the two differ (last-bit accumulation-order differences)."""
    from atlas_lightning.models.adapter_switch import tuner_layers

    worst = {"merge": 0.0, "addmm": 0.0}
    differing, total = 0, 0
    with torch.no_grad():
        for layer in tuner_layers(model.hf_model)[:layers]:
            w = layer.get_base_layer().weight.detach()
            a, b = layer.lora_A[adapter].weight.detach(), layer.lora_B[adapter].weight.detach()
            s = layer.scaling[adapter]
            b_r, a_r = (b * s).to(w.dtype), a.to(w.dtype)
            exact = w.double() + b_r.double() @ a_r.double()
            magnitude = w.double().abs() + b_r.double().abs() @ a_r.double().abs()
            spacing = torch.finfo(w.dtype).eps * torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))))
            bound = spacing + (a.shape[0] + 2) * torch.finfo(torch.float32).eps * magnitude
            results = {"merge": merge_lora(w, b, a, s), "addmm": torch.addmm(w, b_r, a_r)}
            for name, got in results.items():
                worst[name] = max(worst[name], float(((got.double() - exact).abs() / bound).max()))
            differing += int((results["merge"] != results["addmm"]).sum())
            total += w.numel()
    return {"kernel": kernel_applies(w), "merge_error_in_bounds": worst["merge"], "addmm_error_in_bounds": worst["addmm"],
            "differing_fraction": differing / max(total, 1), "linears": min(layers, len(tuner_layers(model.hf_model)))}


def measure_weight_sync(model, device: torch.device, bucket_bytes: int, copy_gbps: float | None) -> dict:
    out: dict = {"bucket_bytes": bucket_bytes}
    state = {}
    seconds = timed(device, lambda: state.update(adapter_state(model, "actor")))
    nbytes = sum(_nbytes(t) for t in state.values())
    out["adapter_state"] = {"seconds": seconds, "bytes": nbytes, "gbps": nbytes / seconds / 1e9, "tensors": len(state)}
    del state
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
        entry = {"seconds": seconds, "times_s": times, "bytes": produced, "gbps_out": produced / seconds / 1e9,
                 "gbps_moved": 2 * produced / seconds / 1e9}
        if copy_gbps:
            entry["fraction_of_copy_bandwidth"] = entry["gbps_moved"] / copy_gbps
        out[name] = entry
    out["kernel_check"] = kernel_check(model)
    return out
