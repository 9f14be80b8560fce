"""What the LoRA weight sync's checks cost on a card, as ``rollout/sync.py`` runs them, against
how they ran before (one tensor at a time; the engine's form made on the host; the marked
actor drawn on the host). CUDA only; nothing but torch and this package.

    atlas-lightning bench sync-checks [--shape qwen3_6_27b] [--layers 16] [--rank 64]
    python -m atlas_lightning.bench.sync_checks                               # the same

The actor adapter of the shape's first ``layers`` decoder layers (every all-linear target, A and
B in float32 as peft keeps them beside a bf16 base) is made on the card, then, each timed twice
(the second is the figure: the first pays allocation and launch set-up):

- ``as_sent``: the digest of the adapter as written (the folder check's and the sync's), one
  ``tensor_digest`` a tensor against ``digest_named`` (batched);
- ``as_held``: the digest of the adapter as vLLM holds it (bf16, B scaled by alpha / r: the held
  check's), the form made on the host and copied back against made on the card;
- ``mark``: the marked actor's draw for every ``lora_B``, on the host and copied against on the card;
- ``export``: the adapter copied to the host and written as a safetensors file, then read back
  onto the card (the export and the folder check's read), in float32 (peft's masters, as before)
  against bf16 (the engines' dtype, as now), under ``$TMPDIR``.

Each pair must give the same digests (the card's held form byte for byte the host's, vLLM's):
a difference is printed and the exit code is 1. The figures go to stdout as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def adapter(shape_name: str, layers: int, rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """``{module: (A, B, scaling)}`` for every linear of the shape's first ``layers`` layers, on
    the card, float32, alpha = 2 r (the report's r64 / alpha 128)."""
    from atlas_lightning.planning.named_shapes import named_config
    from atlas_lightning.planning.shapes import shape_from_config

    shape = shape_from_config({**named_config(shape_name), "num_hidden_layers": layers}, shape_name)
    g = torch.Generator(device="cuda").manual_seed(0)
    modules = {}
    for index, kind in enumerate(shape.layer_types):
        for linear in shape.linears(kind):
            a = torch.randn(rank, linear.in_features, device="cuda", generator=g) * 0.01
            b = torch.randn(linear.out_features, rank, device="cuda", generator=g) * 0.01
            modules[f"model.layers.{index}.{linear.name}"] = (a, b, 2.0)
    return modules


def timed(fn):
    """``(seconds of the second call, its result)``: the first call warms up."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, result


def measure(modules) -> dict:
    from atlas_lightning.rollout import digest

    tensors = [(f"{name}.{factor}", t) for name, (a, b, _) in modules.items() for factor, t in (("A", a), ("B", b))]
    out = {"modules": len(modules), "tensors": len(tensors),
           "values": sum(t.numel() for _, t in tensors), "mismatches": []}

    one_by_one, old = timed(lambda: {name: digest.tensor_digest(t) for name, t in tensors})
    batched, new = timed(lambda: digest.digest_named(tensors).entries)
    out["as_sent_one_by_one_s"], out["as_sent_batched_s"] = one_by_one, batched
    if old != new:
        out["mismatches"].append("as_sent")

    def held_on_host():
        return digest.lora_digest(modules, dtype=torch.bfloat16, scale_b=True, device=None).total

    def held_on_card():
        return digest.lora_digest(modules, dtype=torch.bfloat16, scale_b=True, device="cuda").total

    out["as_held_host_form_s"], host_total = timed(held_on_host)
    out["as_held_card_form_s"], card_total = timed(held_on_card)
    if host_total != card_total:
        out["mismatches"].append("as_held")

    shapes = [b.shape for _, b, _ in modules.values()]

    def draw_on_host():
        g = torch.Generator().manual_seed(1)
        return [torch.randn(s, generator=g).to("cuda") for s in shapes]

    def draw_on_card():
        g = torch.Generator(device="cuda").manual_seed(1)
        return [torch.randn(s, generator=g, device="cuda") for s in shapes]

    out["mark_host_s"], _ = timed(draw_on_host)
    out["mark_card_s"], _ = timed(draw_on_card)
    for dtype in (torch.float32, torch.bfloat16):
        out[f"export_{str(dtype).removeprefix('torch.')}_s"], _ = timed(lambda: export_round_trip(tensors, dtype))
    return out


def export_round_trip(tensors: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> None:
    """``tensors`` in ``dtype`` to the host, written as one safetensors file, read back onto the card."""
    import tempfile

    from safetensors.torch import load_file, save_file

    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/adapter_model.safetensors"
        save_file({name: t.to(dtype).cpu() for name, t in tensors}, path)
        load_file(path, device="cuda")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="atlas-lightning bench sync-checks",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3_6_27b")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rank", type=int, default=64)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("sync_checks: needs a CUDA card", file=sys.stderr)
        return 2
    results = {"shape": args.shape, "layers": args.layers, "rank": args.rank,
               "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               **measure(adapter(args.shape, args.layers, args.rank))}
    print(json.dumps(results, indent=1))
    return 1 if results["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
