"""The ``atlas-lightning bench`` verb (also ``python -m atlas_lightning.bench``): which benchmark a
subcommand runs.

    atlas-lightning bench [OPTIONS]              # the update benchmark (update_bench.py); --tiny on CPU
    atlas-lightning bench NAME [OPTIONS]         # the benchmark NAME (below); NAME --help for its options

Every benchmark is a module of this package and runs the package's own model build, kernels and
config (what ``fit`` runs), so a figure re-measured on another card goes through the same path.
Each module also runs alone: ``python -m atlas_lightning.bench.<module>``. The modules are
imported only when named, so the pure-Python ones (``learning``, ``projection``) start without
torch. An unknown name is refused (exit 2) before anything runs.
"""

from __future__ import annotations

import importlib
import sys

#: subcommand -> (module of this package, what it measures)
BENCHMARKS = {
    "update": ("update_bench", "our PPO update against transformers + peft, forward passes, weight sync "
                               "(the default)"),
    "update-suite": ("update_suite", "the update benchmark's recorded runs on one card, in one process"),
    "step": ("step", "the whole RL step: `fit` itself, timed phase by phase"),
    "step-suite": ("step_suite", "the RL step on one card: kill and resume, merged sync, the 8B step"),
    "projection": ("projection", "the training of record's step, projected from a step report"),
    "learning": ("learning", "whether the embedded default learns: validation objective, paired by question"),
    "attention-lengths": ("attention_lengths", "what a new sequence length costs the attention kernels"),
    "elementwise-kernels": ("elementwise_kernels", "the fused norm, SwiGLU and rotary kernels against torch's ops"),
    "merge-packing": ("merge_packing", "where the merged-weight packing pass spends its time"),
    "digest-cost": ("digest_cost", "what the weight sync's exact digests cost"),
    "sync-checks": ("sync_checks", "the LoRA sync's checks on a card: batched digests, the held form on the card"),
    "depth-rounding": ("depth_rounding", "what bf16 costs the log-probs against float32 by depth: hybrid and dense"),
    "build-time": ("build_time", "the model build's start-up on the card: random, from a folder, the old host path"),
    "head-dtype": ("head_dtype", "what model.head_dtype changes in the trainer's log-probs and costs, "
                                 "against a float64 reference"),
    "gap-sources": ("gap_sources", "where the trainer's and the engine's log-probs part: each against a float32 "
                                   "reference"),
}


def usage() -> str:
    width = max(map(len, BENCHMARKS))
    rows = "\n".join(f"  {name:{width}}  {what}" for name, (_, what) in BENCHMARKS.items())
    return (f"usage: atlas-lightning bench [NAME] [OPTIONS]\n\nbenchmarks (NAME --help: its options; no NAME: "
            f"update):\n{rows}\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(usage(), end="")
        return 0
    name = argv[0] if argv and not argv[0].startswith("-") else "update"
    if name not in BENCHMARKS:
        print(f"atlas-lightning bench: no benchmark {name!r}\n\n{usage()}", file=sys.stderr, end="")
        return 2
    module = importlib.import_module(f"{__package__}.{BENCHMARKS[name][0]}")
    return module.main(argv[1:] if argv[:1] == [name] else argv) or 0
