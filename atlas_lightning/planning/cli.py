"""The ``plan`` verb: compose, plan, print the table, write ``outputs/<name>/plan.json``.

    atlas-lightning plan experiment=<run> [overrides]          (verbs.plan -> run_plan)
    python -m atlas_lightning.planning [--card-gib G] [--json] experiment=<run> [model.linear_attention_kernel=fla] ...

Exit code 0: the plan passes; 2: refused (each reason printed), or the model folder unreadable.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

from . import ShapeError, make_plan
from .report import format_plan, write_plan_json


def run_plan(cfg: Any, *, card_gib: Optional[float] = None, linear_kernel: Optional[str] = None,
             as_json: bool = False, write: bool = True) -> int:
    """Plan ``cfg`` (a composed config), print it, write ``plan.json`` under the run's outputs;
    return the exit code (module doc)."""
    from .model_folder import check_model_folder

    try:
        if Path(str(cfg.model.path)).exists() or not cfg.model.get("shape"):
            check_model_folder(cfg.model.path, loads=False)  # fit's check, of what a plan reads (exit 2)
        plan = make_plan(cfg, card_gib=card_gib, linear_kernel=linear_kernel)
    except (ShapeError, ValueError) as err:
        print(f"atlas-lightning plan: {err}", file=sys.stderr)
        return 2
    path = None
    if write:
        try:  # before printing: a refused write is the verb's only line
            path = write_plan_json(plan, Path(cfg.paths.outputs) / "plan.json")
        except OSError as err:  # an atomic write leaves nothing behind
            print(f"atlas-lightning plan: the run's outputs folder {cfg.paths.outputs}: plan.json cannot be written "
                  f"there ({err.strerror or err}); choose another paths.root, fix the folder's permissions, or "
                  f"pass --no-write", file=sys.stderr)
            return 2
    print(json.dumps(plan.to_dict(), indent=1) if as_json else format_plan(plan))
    if path is not None and not as_json:
        print(f"written: {path}")
    return 0 if plan.ok else 2


def main(argv: Optional[list[str]] = None) -> int:
    from atlas_lightning.config import ConfigError, compose

    parser = argparse.ArgumentParser(prog="python -m atlas_lightning.planning", description=__doc__.split("\n")[0])
    parser.add_argument("overrides", nargs="*", help="hydra overrides, e.g. experiment=r28-continued-cost-8gpu-n32")
    parser.add_argument("--card-gib", type=float, default=None, help="memory of one card in GiB (default: plan.card_gib, 80)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of the table")
    parser.add_argument("--config-dir", default=None, help="a folder of your own config groups")
    parser.add_argument("--no-write", action="store_true", help="do not write outputs/<name>/plan.json")
    args = parser.parse_args(argv)
    try:
        cfg = compose(args.overrides, user_config_dir=args.config_dir)
    except ConfigError as err:
        print(f"atlas-lightning plan: config error: {err}", file=sys.stderr)
        return 2
    return run_plan(cfg, card_gib=args.card_gib, as_json=args.json, write=not args.no_write)
