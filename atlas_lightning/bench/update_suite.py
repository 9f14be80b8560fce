"""The update benchmark's recorded runs on one card, in ONE process (flash-linear-attention's
autotuning and the compiled kernels then serve every step):

1. the fla correctness test (``tests/models/test_linear_attention.py``, from a checkout): packed
   fla against transformers one sequence at a time; it also pays fla's first autotuning;
2. ``27b``: the 27B shape (first 16 layers): the option sweep on 4 layers (plan figures beside
   the measured peaks), our update with ``fit``'s recomputation (``model.checkpoint_layers=auto``
   for the card's free memory, a plan per micro-batch size), the autotune probe (a new
   micro-batch length), a profile of one actor micro-step;
3. ``dense``: the dense 8B shape: the sweep, then the 32-sequence batch update with its optimizer
   step, ours planned as ``fit`` plans it for at most 60 GiB free, against transformers + peft;
4. ``27b-baseline``: transformers + peft on the 27B shape (its torch Gated DeltaNet), timed on its
   first update.

    atlas-lightning bench update-suite --out $OUT [--budget-s 560] [--skip-test] [--only 27b,27b-baseline]
    atlas-lightning bench update-suite --out $OUT --run run15e --skip-test --only dense,dense-torch \\
        --dense-cap-gib 58 --batch-repeats 2        # the dense batch, with PyTorch's element-wise ops beside
    python -m atlas_lightning.bench.update_suite ...   # the same

``dense-torch`` (only when named): our dense batch again with ``--elementwise-kernels torch``
(the fused kernels' share); ``--elementwise-kernels`` sets our path's kernels everywhere,
``--dense-cap-gib`` the free memory the dense plan is made for, at most, ``--batch-repeats`` how many times ours updates the
same batch (the second: every attention length bucket seen), ``--batch-from
artifacts/<name>/train/step_N`` the dense batch is the one ``fit`` trained on at that step (with
its run's epochs, mini-batches and budget: the same work as that step's ``update_actor``).
``--tiny``: the same steps on toy shapes on CPU (the plumbing).

Each step writes ``$OUT/<run>-<step>.json`` and ``.md`` as it goes; a step starts only if the time
left allows, and the last lines printed are the summary table. Sets
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless set (as every recorded run had it),
the allocator ``fit``'s update runs under too (``rollout/engines/trainer_allocator.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# before torch makes its first CUDA allocation (the allocator reads it once)
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
os.environ.setdefault("PYTHONUNBUFFERED", "1")
#: the correctness test of the packed fla path; it lives in a checkout, not in the installed package
FLA_TEST = Path(__file__).resolve().parents[2] / "tests" / "models" / "test_linear_attention.py"


def _steps(args: argparse.Namespace) -> list[tuple[str, list[str], int, int]]:
    """(label, update benchmark arguments, seconds a step needs to start, seconds it leaves to
    the steps after it), every step the suite knows."""
    recorded = ["--batch-from", args.batch_from] if args.batch_from else []
    kernels = ["--elementwise-kernels", args.elementwise_kernels] if args.elementwise_kernels else []
    steps = [
        ("27b", ["--models", "qwen3_6_27b", "--layers", "qwen3_6_27b=16", "--sweep-layers", "4",
                 "--sweep", "ours,ours_none", "--sweep-warmup", "0", "--reps", "1", "--paths", "ours",
                 "--sections", "peak,update,autotune,profile"], 60, 140),
        ("dense", ["--models", "dense8b", "--sweep-layers", "4", "--sweep", "ours,ours_none,ours_mixer,ours_mlp",
                   "--sweep-warmup", "0", "--sections", "peak,batch,profile", "--batch-sequences", "32",
                   "--batch-cap-gib", str(args.dense_cap_gib), *kernels,
                   "--batch-repeats", str(args.batch_repeats), *recorded], 100, 0),
        # ours alone with PyTorch's element-wise ops: the same plan, for the fused kernels' share
        ("dense-torch", ["--models", "dense8b", "--sweep-layers", "4", "--sweep", "ours,ours_none,ours_mixer,ours_mlp",
                         "--sweep-warmup", "0", "--sections", "peak,batch", "--batch-sequences", "32",
                         "--batch-cap-gib", str(args.dense_cap_gib), "--elementwise-kernels", "torch",
                         "--paths", "ours", *recorded], 80, 0),
        ("27b-baseline", ["--models", "qwen3_6_27b", "--layers", "qwen3_6_27b=16", "--sweep-layers", "0",
                          "--reps", "1", "--baseline-warmup", "0", "--paths", "baseline",
                          "--sections", "peak,update"], 55, 0),
    ]
    if args.tiny:
        swap = {"qwen3_6_27b": "tiny_hybrid", "dense8b": "tiny", "qwen3_6_27b=16": "tiny_hybrid=4", "4": "2", "32": "4"}
        steps = [(label, ["--tiny", "--batch-budgets", "1024,800", *[swap.get(a, a) for a in argv]], 0, 0)
                 for label, argv, _, _ in steps]
    return steps


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list]:
    """The options and the steps they select; an unknown step is refused (exit 2) before anything runs."""
    p = argparse.ArgumentParser(prog="atlas-lightning bench update-suite", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench-out")
    p.add_argument("--run", default="suite", help="the prefix of every file written (<run>-<step>.json)")
    p.add_argument("--budget-s", type=float, default=560.0)
    p.add_argument("--skip-test", action="store_true", help="leave out the fla correctness test")
    p.add_argument("--tiny", action="store_true", help="CPU plumbing check on toy shapes")
    p.add_argument("--only", default="",
                   help="comma-separated steps to run (27b, dense, dense-torch, 27b-baseline; default all but dense-torch)")
    p.add_argument("--elementwise-kernels", default=None, choices=("auto", "liger", "torch"),
                   help="our path's norm/SwiGLU/rotary kernels (model.elementwise_kernels; default auto, or with "
                        "--batch-from the run's)")
    p.add_argument("--batch-repeats", type=int, default=1, help="timed updates of ours on the dense batch")
    p.add_argument("--dense-cap-gib", type=float, default=60.0,
                   help="the free memory the dense batch's plan is made for, at most (--batch-cap-gib)")
    p.add_argument("--batch-from", default=None, metavar="STEP_FOLDER",
                   help="the dense batch is the one fit trained on at artifacts/<name>/train/step_N, with that "
                        "run's epochs, mini-batches and budget (update_bench --batch-from)")
    args = p.parse_args(argv)
    steps = _steps(args)
    if args.only:
        wanted = args.only.split(",")
        unknown = set(wanted) - {label for label, *_ in steps}
        if unknown:
            p.error(f"--only: no step {', '.join(sorted(unknown))}")
        return args, [step for step in steps if step[0] in wanted]
    return args, [step for step in steps if step[0] != "dense-torch"]


def fla_test() -> dict:
    """The packed fla path against transformers, one sequence at a time (pytest, in this process)."""
    if not FLA_TEST.is_file():
        return {"skipped": f"{FLA_TEST} not found: run from a checkout"}
    import pytest

    started = time.monotonic()
    code = pytest.main(["-q", "-rs", "-s", str(FLA_TEST), "-p", "no:cacheprovider"])
    return {"exit": int(code), "seconds": round(time.monotonic() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    args, steps = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    left = lambda: args.budget_s - (time.monotonic() - started)  # noqa: E731
    summary = {}
    if not args.skip_test:
        summary["fla test"] = fla_test()
        print(f"[update-suite] fla test {summary['fla test']}", flush=True)

    from atlas_lightning.bench.update_bench import main as bench

    for label, bench_args, needs, keep in steps:
        if left() < needs:
            print(f"[update-suite] {label}: skipped, {left():.0f} s left", flush=True)
            summary[label] = "skipped"
            continue
        path = out / f"{args.run}-{label}.json"
        t = time.monotonic()
        bench([*bench_args, "--deadline-s", str(max(left() - keep, 10)), "--out", str(path)])
        summary[label] = {"seconds": round(time.monotonic() - t, 1), "json": path.name}

    print("\n[update-suite] summary", json.dumps(summary))
    for row in summary_rows(out, args.run):
        print(" | ".join(str(c) for c in row))
    return 0


def summary_rows(out: Path, run: str) -> list[tuple]:
    """The table printed last: one row a shape, path and update, from the steps' JSON files."""
    rows = [("shape", "path", "s", "tokens/s", "MFU", "peak GiB", "plan")]
    for label in ("27b", "27b-baseline", "dense", "dense-torch"):
        path = out / f"{run}-{label}.json"
        if not path.exists():
            continue
        for name, model in json.loads(path.read_text()).get("models", {}).items():
            for which in ("ours", "baseline"):
                update = model.get(which, {}).get("update", {})
                if update.get("median_s"):
                    plan = model[which].get("options", {}).get("layer_recompute", "")
                    rows.append((name, which, f"{update['median_s']:.2f}", f"{update['tokens_per_s']:.0f}",
                                 f"{100 * update.get('useful_mfu', 0):.1f}%", f"{update.get('peak_gib') or 0:.1f}",
                                 _short(plan)))
            batch = model.get("batch", {})
            for which, key in (("ours", "update"), ("ours", "update_2"), ("baseline", "update")):
                update = batch.get(which, {}).get(key, {})
                if update.get("seconds"):
                    attempt = batch[which]["attempts"][-1]
                    rows.append((f"{name} batch ({label})", which + ("" if key == "update" else f" ({key})"), f"{update['seconds']:.2f}", f"{update['tokens_per_s']:.0f}",
                                 f"{100 * update.get('useful_mfu', 0):.1f}%", f"{update.get('peak_gib') or 0:.1f}",
                                 f"{attempt.get('budget', '')} {_short(attempt.get('layer_recompute', ''))}"))
    return rows


def _short(plan) -> str:
    if not isinstance(plan, list):
        return str(plan)
    return ",".join(f"{p}x{plan.count(p)}" for p in ("layer", "mixer", "mlp", "none") if p in plan)


if __name__ == "__main__":
    sys.exit(main())
