"""Where the merged-weight packing spends its time (issue 9): kernels of one ``merged_weight_packs``
pass over the 8B shape, and one linear's merge next to a plain copy.

    python3 bench/profile_merge.py [--layers 36] [--out profile_merge.json]

Prints torch.profiler's kernel table (top 20 by device time) and a JSON line of per-op timings.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from atlas_lightning.bench.shapes import build_model, shape_by_name
from atlas_lightning.bench.update import lora_spec
from atlas_lightning.models.actor_critic import ActorCritic
from atlas_lightning.models.weights import _merged_sources, merged_weight_packs


def timed(fn, reps: int = 5) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--shape", default="dense8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="profile_merge.json")
    args = p.parse_args()
    device = torch.device(args.device)
    base = build_model(shape_by_name(args.shape), device=device, dtype=torch.bfloat16, attn_implementation="sdpa",
                       layers=args.layers, seed=0)
    model = ActorCritic(base, lora_spec(64), gradient_checkpointing=False)
    with torch.no_grad():
        for param in model.actor_parameters():
            param.normal_(0, 0.01)
    out: dict = {}
    out["walk_only_s"] = timed(lambda: sum(1 for _ in _merged_sources(model, "actor")))
    out["packs_s"] = timed(lambda: sum(b.numel() for b, _ in merged_weight_packs(model, "actor")))
    layer = model.decoder_layers()[0].mlp.down_proj
    w = layer.get_base_layer().weight
    a = layer.lora_A["actor"].weight.detach().to(w.dtype)
    b = (layer.lora_B["actor"].weight.detach() * 2.0).to(w.dtype)
    dst = torch.empty_like(w)
    nbytes = w.numel() * w.element_size()
    for name, fn in {
        "copy": lambda: dst.copy_(w),
        "addmm_out": lambda: torch.addmm(w, b, a, out=dst),
        "addmm_new": lambda: torch.addmm(w, b, a),
        "mm_then_add": lambda: torch.add(w, b @ a, out=dst),
    }.items():
        seconds = timed(fn, reps=20)
        out[name] = {"s": seconds, "gbps_moved": 2 * nbytes / seconds / 1e9, "shape": list(w.shape)}
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        sum(b.numel() for b, _ in merged_weight_packs(model, "actor"))
    print(prof.key_averages().table(sort_by=("cuda_time_total" if device.type == "cuda" else "cpu_time_total"), row_limit=20), flush=True)
    print(json.dumps(out), flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
