"""Where the merged-weight packing pass spends its time: one ``merged_weight_packs`` pass over
the 8B shape, grouped launches against one launch per linear, host (queueing) time against the
whole pass, each kernel tile of a sweep, and one linear's merge next to a plain copy.

    atlas-lightning bench merge-packing [--layers 36] [--tiles] [--out merge_packing.json]
    python -m atlas_lightning.bench.merge_packing [...]          # the same

Prints torch.profiler's kernel table (top 20 by device time) of the grouped pass and a JSON line:
``packs_s`` (whole pass, synchronised), ``packs_host_s`` (until the last launch is queued),
``per_linear_s`` (the same pass with every merge launched alone), ``slots_<n>`` (at most n merges a
launch), ``first_pass_s`` (the first pass, compiling included), ``tiles`` (pass time per
``merge_kernel.TILE`` candidate), ``gbps_moved`` = 2 x merged bytes / time (read W, write out)
against ``copy_gbps`` (a 1 GiB device copy, read + write). The weight-sync section of the update
benchmark (``sync.py``) times the same pass inside a whole benchmark process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from unittest import mock

import torch

from atlas_lightning.bench.shapes import shape_by_name, transformers_config
from atlas_lightning.bench.update import fit_model_config
from atlas_lightning.models import merge_kernel
from atlas_lightning.models.build import build_actor_critic
from atlas_lightning.models.weights import merged_weight_packs
from atlas_lightning.store.atomic import atomic_write_text

#: Run 7 (bench/NOTES.md) timed 64x256/8, 128x128/8, 128x256/8, 64x128/4, 32x256/4 and 64x512/8:
#: 64x128 with 4 warps won (73% of copy bandwidth); these are its neighbours.
TILES = [
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4},
    {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4},
    {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 2},
    {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 4},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4},
    {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 2},
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8},
]


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps: int = 5) -> float:
    fn()
    synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="atlas-lightning bench merge-packing", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--shape", default="dense8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiles", action="store_true", help="time each TILE candidate")
    p.add_argument("--reps", type=int, default=5, help="timed passes (the minimum is reported)")
    p.add_argument("--out", default="merge_packing.json")
    args = p.parse_args(argv)
    with torch.no_grad():
        measure(args)
    return 0


def measure(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    model = build_actor_critic(fit_model_config(64, 1024, gradient_checkpointing=False, attn_implementation="sdpa"),
                               device=device, random_base=transformers_config(shape_by_name(args.shape), args.layers))
    with torch.no_grad():
        for param in model.actor_parameters():
            param.normal_(0, 0.01)

    def packs() -> int:
        return sum(b.numel() for b, _ in merged_weight_packs(model, "actor"))

    out: dict = {"tile": merge_kernel.TILE, "group_slots": merge_kernel.GROUP_SLOTS,
                 "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    out["copy_gbps"] = 2 * src.numel() / timed(lambda: dst.copy_(src), reps=10) / 1e9
    src = dst = None  # their memory back before the merge passes
    start = time.perf_counter()
    nbytes = packs()
    synchronize()
    out["first_pass_s"] = time.perf_counter() - start  # includes compiling the kernels
    out["merged_bytes"] = nbytes

    def rate(seconds: float) -> dict:
        moved = 2 * nbytes / seconds / 1e9
        return {"s": seconds, "gbps_moved": moved, "of_copy": moved / out["copy_gbps"]}

    out["packs"] = rate(timed(packs, args.reps))
    out.update(launch_costs(packs, rate, device, args.reps))
    if args.tiles:
        out["tiles"] = []
        for tile in TILES:
            with mock.patch.object(merge_kernel, "TILE", tile):
                out["tiles"].append({**tile, **rate(timed(packs, args.reps))})
            print(json.dumps(out["tiles"][-1]), flush=True)
    out.update(one_linear(model))
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        packs()
        synchronize()
    print(prof.key_averages().table(sort_by=("cuda_time_total" if device.type == "cuda" else "cpu_time_total"), row_limit=20), flush=True)
    print(json.dumps(out), flush=True)
    atomic_write_text(args.out, json.dumps(out, indent=1) + "\n")


def launch_costs(packs, rate, device, reps: int) -> dict:
    """The pass's host (queueing) time, per-linear and fewer-slot launches, the host cost of the
    pass without merges and of one grouped launch of tiny merges."""
    out: dict = {}
    host = []
    for _ in range(5):
        synchronize()
        start = time.perf_counter()
        packs()
        host.append(time.perf_counter() - start)
    synchronize()
    out["packs_host_s"] = min(host)
    with mock.patch.object(merge_kernel, "_groupable", lambda job: False):
        out["per_linear"] = rate(timed(packs, reps))
    for slots in (4, 8):  # fewer merges a launch than GROUP_SLOTS: more launches
        with mock.patch.object(merge_kernel, "GROUP_SLOTS", slots):
            out[f"slots_{slots}"] = rate(timed(packs, reps))
    # host cost of the pieces: the pass without merges, and one grouped launch of tiny merges
    with mock.patch("atlas_lightning.models.weights.merge_lora_many", lambda jobs: None):
        out["host_without_merges_s"] = timed(packs, reps)
    small = [merge_kernel.MergeJob(torch.randn(64, 64, device=device, dtype=torch.bfloat16),
                                   torch.randn(64, 64, device=device), torch.randn(64, 64, device=device), 2.0,
                                   torch.empty(64, 64, device=device, dtype=torch.bfloat16)) for _ in range(4)]
    for n in (1, 4):
        merge_kernel.merge_lora_many(small[:n])
        synchronize()
        start = time.perf_counter()
        for _ in range(200):
            merge_kernel.merge_lora_many(small[:n])
        out[f"host_per_launch_{n}_jobs_us"] = (time.perf_counter() - start) / 200 * 1e6
        synchronize()
    return out


def one_linear(model) -> dict:
    """One linear's merge (the kernel, ``torch.addmm(out=)``) next to a plain copy of its weight."""
    out: dict = {}
    layer = model.decoder_layers()[0].mlp.down_proj
    w = layer.get_base_layer().weight
    a = layer.lora_A["actor"].weight.detach().to(w.dtype)
    b = (layer.lora_B["actor"].weight.detach() * 2.0).to(w.dtype)
    dst = torch.empty_like(w)
    one = w.numel() * w.element_size()
    for name, fn in {
        "copy": lambda: dst.copy_(w),
        "kernel": lambda: merge_kernel.merge_lora(w, layer.lora_B["actor"].weight, layer.lora_A["actor"].weight, 2.0, dst),
        "addmm_out": lambda: torch.addmm(w, b, a, out=dst),
    }.items():
        seconds = timed(fn, reps=20)
        out[name] = {"s": seconds, "gbps_moved": 2 * one / seconds / 1e9, "shape": list(w.shape)}
    return out

if __name__ == "__main__":
    sys.exit(main())
