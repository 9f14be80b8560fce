"""Does the embedded default learn? Train ``experiment=tiny-cpu`` at several seeds and compare the
validation objective of the last step with step 0's, question by question.

    python -m atlas_lightning.bench.learning --root /tmp/learning --seeds 0 1     # train, then report
    python -m atlas_lightning.bench.learning --root /tmp/learning --seeds 0 1 --report-only
    python -m atlas_lightning.bench.learning --root R --seeds 0 -- trainer.total_steps=4   # overrides

Each seed runs ``atlas-lightning fit experiment=tiny-cpu seed=S data.seed=S name=tiny-cpu-seedS
paths.root=ROOT`` in a subprocess (a run already finished under ROOT is reused), then the
validation records it wrote (``artifacts/<name>/val/step_N/*.json``: tiny-cpu samples 6
trajectories a question at temperature 1, with the same request seeds at every validation) are
read back. The overrides are composed first, as each seed's ``fit`` will: a bad one is refused
(exit 2, one line naming the key) before anything is written; a ``fit`` that fails ends this with
its exit code. Figures, per seed and validation step: the objective ``acc - lambda *
dollars`` (the reward breakdown's ``objective``), accuracy, dollars, explores per episode. The
test of learning is paired: for every validation question, the objective at the last step minus
the objective at step 0; the mean difference and its standard error (sample standard deviation
of the differences / sqrt(questions)); ``z`` = mean / SE. Learning is shown when ``z > 3``.

Output: a markdown table on stdout and ``ROOT/learning.json``. Who calls it: people, and the
README's figures come from it. The reading and the test are ``store/learning_curve.py``'s, which
``fit``'s closing summary prints for any run. Needs no torch (hydra to compose; the CLI it launches).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from atlas_lightning.run.exit_codes import exit_code
from atlas_lightning.store.learning_curve import read_step, summarize, val_steps
from atlas_lightning.store.atomic import atomic_write_text

EXPERIMENT = "tiny-cpu"


def run_name(seed: int) -> str:
    return f"{EXPERIMENT}-seed{seed}"


def fit_command(root: Path, seed: int, overrides: list[str]) -> list[str]:
    """The ``atlas-lightning fit`` command line of one seed's run under ``root``."""
    return [sys.executable, "-m", "atlas_lightning.cli", "fit", *fit_overrides(root, seed, overrides)]


def fit_overrides(root: Path, seed: int, overrides: list[str]) -> list[str]:
    """One seed's overrides: the experiment, the seed, the run's name and root (resumed: a seed's
    run stopped part-way goes on from its last checkpoint), then the user's."""
    return [f"experiment={EXPERIMENT}", f"seed={seed}", f"data.seed={seed}", f"name={run_name(seed)}",
            f"paths.root={root}", "trainer.resume=auto", *overrides]


def check_overrides(root: Path, seeds: list[int], overrides: list[str]) -> None:
    """Every seed's config composed as its ``fit`` will compose it: a ``ConfigError`` naming the
    key before anything is written or started."""
    from atlas_lightning.config import compose

    for seed in seeds:
        compose(fit_overrides(root, seed, overrides))


def train(root: Path, seed: int, overrides: list[str]) -> float:
    """Run one seed's ``fit`` unless ROOT already holds its finished run; seconds it took (0 if reused).
    A ``fit`` that fails raises ``CalledProcessError`` (its own line is on stderr already)."""
    name = run_name(seed)
    if (root / "checkpoints" / name / "latest_checkpointed_iteration.txt").is_file() and _finished(root, name):
        return 0.0
    command = fit_command(root, seed, overrides)
    print("$ " + " ".join(command), file=sys.stderr, flush=True)
    started = time.monotonic()
    subprocess.run(command, check=True, env=dict(os.environ, WANDB_MODE=os.environ.get("WANDB_MODE", "offline")))
    return time.monotonic() - started


def _finished(root: Path, name: str) -> bool:
    summary = root / "outputs" / name / "learning_done.json"
    return summary.is_file()


def markdown(results: dict) -> str:
    lines = ["| seed | step | objective | acc | $ / episode | explores | questions |", "|---|---|---|---|---|---|---|"]
    for seed, result in results["seeds"].items():
        for step, row in result["curve"].items():
            lines.append(f"| {seed} | {step} | {row['objective']:+.3f} | {row['acc']:.3f} | {row['cost_usd']:.3f} | "
                         f"{row['explores']:.2f} | {row['questions']} |")
    lines += ["", "| seed | steps | objective gain (last - step 0) | SE (paired) | z | train minutes |",
              "|---|---|---|---|---|---|"]
    for seed, result in results["seeds"].items():
        lines.append(f"| {seed} | {result['first_step']} -> {result['last_step']} | {result['objective_gain']:+.3f} | "
                     f"{result['gain_se']:.3f} | {result['z']:.1f} | {result['train_seconds'] / 60:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m atlas_lightning.bench.learning", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True, help="where the runs are written (and reused)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--report-only", action="store_true", help="read finished runs, train nothing")
    parser.add_argument("overrides", nargs="*", help="hydra overrides for every seed's fit (after --)")
    args = parser.parse_args(argv)
    try:
        return exit_code(parser.prog, lambda: learn(args))
    except subprocess.CalledProcessError as err:  # a seed's fit refused or stopped: its line is above
        run = next(arg.removeprefix("name=") for arg in err.cmd if arg.startswith("name="))
        print(f"{parser.prog}: the fit of {run} exited {err.returncode} (its own line is above)", file=sys.stderr)
        return err.returncode if err.returncode > 0 else 1


def learn(args: argparse.Namespace) -> int:
    """Train each seed (unless ``--report-only``), then the table and ``ROOT/learning.json``."""
    if not args.report_only:
        check_overrides(args.root, args.seeds, args.overrides)
    args.root.mkdir(parents=True, exist_ok=True)
    results: dict = {"experiment": EXPERIMENT, "overrides": args.overrides, "seeds": {}}
    for seed in args.seeds:
        name = run_name(seed)
        seconds = 0.0
        if not args.report_only:
            seconds = train(args.root, seed, args.overrides)
            done = args.root / "outputs" / name / "learning_done.json"
            if seconds:
                atomic_write_text(done, json.dumps({"train_seconds": seconds}) + "\n")
            else:
                seconds = json.loads(done.read_text())["train_seconds"]
        steps = val_steps(Path(args.root) / "artifacts" / name)
        if len(steps) < 2:
            raise SystemExit(f"{args.root}/artifacts/{name}/val holds validation steps {list(steps)}: need step 0 and a later one")
        result = summarize({step: read_step(folder) for step, folder in steps.items()})
        result["train_seconds"] = seconds
        results["seeds"][seed] = result
    atomic_write_text(args.root / "learning.json", json.dumps(results, indent=2) + "\n")
    print(markdown(results))
    return 0

if __name__ == "__main__":
    sys.exit(main())
