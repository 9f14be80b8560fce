"""The start-up of the one model build (``models/build.py``) on this machine's card, per shape.

    python -m atlas_lightning.bench.build_time --shape dense8b --folder /tmp/dense8b --out OUT.json [--host]
    python -m atlas_lightning.bench.build_time --shape qwen3_6_27b --layers 16 --folder /tmp/q27 --out OUT.json

What is timed, each a ``build_actor_critic`` of ``fit``'s model config (``update.fit_model_config``:
LoRA r64 on all linear layers, bf16, ``sdpa_varlen``, ``auto`` kernels), on the card:

* ``random``: random weights of the shape built on the card (the benchmarks' base);
* ``folder``: the same weights written once as a Hugging Face folder (``step.build_model_folder``;
  the writing is timed apart) and read from it onto the card: what ``fit`` does in
  ``configure_model`` (``device=trainer.strategy.root_device``);
* ``host`` (``--host``): the folder built on the host and moved to the card afterwards, as
  ``configure_model`` built it before the build took the device (Lightning then moved it).

Each gives its seconds, the peak of the card's allocator, and the kernels ``auto`` chose there
(``elementwise_kernels``, ``attention_length_bucket``, ``linear_attention_kernel``). Sharding is
not included (one card: FSDP2 keeps every row). Output: ``--out`` (JSON), a line per build printed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import torch

from atlas_lightning.store.atomic import atomic_write_text

from . import measure
from .shapes import shape_by_name, transformers_config
from .update import fit_model_config


def _timed_build(label: str, device: torch.device, build) -> dict[str, Any]:
    """``build()`` (returns an ``ActorCritic``, and where it ends up), timed to the card's sync."""
    measure.free_memory(device)
    measure.reset_peak(device)
    started = time.perf_counter()
    model = build()
    measure.sync(device)
    entry = {"build": label, "seconds": round(time.perf_counter() - started, 2), "peak_gib": measure.peak_gib(device),
             "built_on": str(model.built_on), "elementwise_kernels": model.elementwise_kernels,
             "attention_length_bucket": model.attention_length_bucket,
             "linear_attention_kernel": model.linear_attention_kernel,
             "parameters_on": str(next(model.parameters()).device)}
    print(f"[build_time] {json.dumps(entry)}", flush=True)
    return entry


def measure_builds(shape_name: str, layers: Optional[int], folder: Path, device: torch.device, host: bool,
                   rank: int = 64, chunk: int = 1024) -> dict[str, Any]:
    """The builds of the module doc for one shape; the folder is removed afterwards."""
    from atlas_lightning.models.build import build_actor_critic

    from .step import build_model_folder

    shape = shape_by_name(shape_name)
    random_cfg = fit_model_config(rank, chunk)
    out: dict[str, Any] = {"shape": shape_name, "layers": layers or shape.num_layers, "builds": []}
    out["builds"].append(_timed_build("random", device, lambda: build_actor_critic(
        random_cfg, device=device, random_base=transformers_config(shape, layers))))
    started = time.perf_counter()
    build_model_folder(shape_name, folder, folder / "no-tokenizer", layers)
    out["folder_write_s"] = round(time.perf_counter() - started, 1)
    out["folder_gib"] = sum(f.stat().st_size for f in folder.iterdir()) / 2**30
    folder_cfg = fit_model_config(rank, chunk, path=str(folder))
    out["builds"].append(_timed_build("folder", device, lambda: build_actor_critic(folder_cfg, device=device)))
    if host:
        out["builds"].append(_timed_build("host", device, lambda: build_actor_critic(folder_cfg).to(device)))
    shutil.rmtree(folder, ignore_errors=True)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m atlas_lightning.bench.build_time", description=__doc__.splitlines()[0])
    p.add_argument("--shape", required=True, help="a bench/shapes.py shape")
    p.add_argument("--layers", type=int, default=None, help="the first N decoder layers")
    p.add_argument("--folder", type=Path, required=True, help="where the shape's folder is written (then removed)")
    p.add_argument("--host", action="store_true", help="also build on the host and move to the card")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    result = measure_builds(args.shape, args.layers, args.folder, device, args.host)
    atomic_write_text(args.out, json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
