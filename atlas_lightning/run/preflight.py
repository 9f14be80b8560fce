"""Pre-flight: everything a launch needs, checked in seconds, before any model or engine starts.

    atlas-lightning preflight experiment=<run> [overrides] [--cpu-preflight] [--card-gib G]
    (also python -m atlas_lightning.run.preflight ...)

Checks, in order (each prints one line; the exit code is 0 when all pass, 2 otherwise):

1. ``config``: the config composes and validates (an unknown key or bad value is named);
   ``callbacks``: every configured callback builds from its arguments, as ``fit`` builds it
   (``run/wiring.build_callbacks``: names and types checked, an injected fault that would strike);
   ``reward``: the reward scorer builds from ``reward``'s keys, as ``fit``'s datamodule builds it
   (``reward/scorer.build_scorer``: a scorer from outside the package imported, its arguments taken);
2. ``model``: ``model.path`` is a local folder with a readable ``config.json`` of a known
   family, a tokenizer and weight files, checked as ``fit`` checks them: the weights are
   exactly the tensors of the architecture (built on the meta device: no tensor is read), the
   tokenizer loads and its chat template renders the tools;
3. ``data``: the train and validation splits of every benchmark load as ``fit`` loads them
   (``questions.loader.load_splits``: a bad file, row or field is named, and so is a question of
   both splits);
4. ``adapters``: the starting adapters (``trainer.init_from``'s ``actor``/``critic``, or
   ``model.actor_adapter``/``critic_adapter``) are PEFT folders whose base (``atlas_base.json``,
   when present) has this base's config fields, whose tensors are readable and finite (read as
   ``fit`` reads them) and have the shapes their own ``adapter_config.json`` (rank, target
   modules, per-module ranks) and this base imply; the critic's value head too
   (``value_head.safetensors``, or a module of ``modules_to_save``). Each adapter trains its
   folder's LoRA shape, actor and critic alike, whatever ``model.lora`` says: the line printed
   names the shape, and says so when the config's differs. Fresh adapters print the shape the
   config gives them. The weights fingerprint is checked by ``fit``'s start-up
   (``run/facts.py``) and when the trainer loads them (``models/adapters.py``);
5. ``resume``: ``trainer.resume`` resolved and verified as ``fit`` resolves it
   (``run/facts.resume_path``: a missing or damaged checkpoint, a state not whole, adapters of
   other LoRA settings, kept trajectories this config would not continue);
6. ``plan``: ``planning.make_plan`` passes (layouts and memory; cards of ``plan.card_gib``
   GiB, default 80, or ``--card-gib``);
7. ``environment``: enough GPUs on this node for ``trainer.devices``, vLLM importable when the
   engine is vLLM (found, not imported), every folder the run writes writable
   (``run/facts.check_writable``, as ``fit``), a W&B key when logging online.

``--cpu-preflight`` relaxes only the GPU count, and says so: it lets a GPU run's real config be
checked on a CPU machine (tests swap in the tiny model; the launchers pass it when their
``ATLAS_CPU_PREFLIGHT=1`` is set).

Who calls it: every ``launch/*.sh`` before its run, tests.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from atlas_lightning.config import ConfigError, compose


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    seconds: float = 0.0


class PreflightError(ValueError):
    """A check failed; the message says what and where."""


# ----------------------------------------------------------------------------- the checks


def check_model(cfg) -> str:
    from atlas_lightning.planning.model_folder import check_model_folder
    from atlas_lightning.planning.shapes import model_weight_files, read_model_shape

    from atlas_lightning.models.build import check_base_config, check_base_weights
    from atlas_lightning.models.serving_files import check_serving_files
    from atlas_lightning.run.base_values import check_finite_base
    from atlas_lightning.rollout.step_questions import chat_format

    folder = Path(cfg.model.path)
    check_model_folder(folder)  # the one check fit, validate, memory-check and plan make
    base_config = check_base_config(folder)
    check_base_weights(folder, base_config)  # fit's: the weights are the architecture's, on the meta device
    check_finite_base(folder)  # fit's: every value of the base finite
    check_serving_files(folder, base_config, cfg.rollout.max_model_len)  # fit's: the files beside them
    chat_format(cfg)  # fit's: the tokenizer loads, its chat template renders the tools
    shape = read_model_shape(folder)
    files = model_weight_files(folder)
    return (f"{folder}: {shape.model_type}, {shape.base_params / 1e9:.3g}B parameters, {shape.num_layers} layers, "
            f"{len(files)} weight file(s)")


def check_callbacks(cfg) -> str:
    """Every configured callback, built as ``fit`` builds it (nothing is written)."""
    from atlas_lightning.run.wiring import build_callbacks

    built = build_callbacks(cfg)
    return f"{len(built)} built: {', '.join(type(c).__name__ for c in built)}"


def check_data(cfg) -> str:
    """The splits, loaded and checked as ``fit`` loads them (``run/facts.check_inputs``): the key
    ``data.root``, every row, the subset columns and no question in both splits."""
    from atlas_lightning.questions.loader import load_splits
    from atlas_lightning.run.facts import check_data_root

    check_data_root(cfg.data)  # fit's own check of the key
    splits = load_splits(cfg.data)  # the validation split capped at data.val_max_questions, as fit's
    counts = f"{cfg.data.train_split} {len(splits.train)}, {cfg.data.val_split} {len(splits.val)}"
    return f"{cfg.data.root}: {counts} questions ({', '.join(cfg.data.benchmarks)})"


def starting_adapters(cfg) -> dict[str, Path]:
    """The adapter folders the trainer will start from (``store.lora_shapes.starting_adapters``,
    as ``PPOModule`` resolves them)."""
    from atlas_lightning.store.lora_shapes import starting_adapters as resolve

    return {role: Path(folder) for role, folder in resolve(cfg).items()}


def check_adapters(cfg) -> str:
    from atlas_lightning.planning.shapes import read_model_shape
    from atlas_lightning.run.adapter_files import check_adapter

    from atlas_lightning.store.lora_shapes import ROLES, config_lora_shape

    from atlas_lightning.models.adapters import read_adapter_folder

    folders = starting_adapters(cfg)
    shape = read_model_shape(cfg.model.path) if folders else None
    for role, folder in folders.items():
        read_adapter_folder(folder, role)  # fit's: its files readable, every tensor finite, its own role
    return "; ".join(check_adapter(cfg, shape, role, folders[role]) if role in folders
                     else f"{role} fresh: {config_lora_shape(cfg, role).describe()} ({config_lora_shape(cfg, role).source})"
                     for role in ROLES)


def check_reward(cfg) -> str:
    from atlas_lightning.reward.scorer import build_scorer

    scorer = build_scorer(cfg.reward)
    return f"{cfg.reward.get('_target_')} ({type(scorer).__name__})"


def check_resume(cfg) -> str:
    """``trainer.resume`` as ``fit`` resolves it (``run/facts.resume_path``): null, ``auto`` (the
    newest checkpoint of the run that verifies, or none) or a ``global_step_N`` folder that
    verifies, its state whole, its adapters of this run's LoRA settings and base, and the
    trajectories it keeps in flight continued by this config."""
    from atlas_lightning.config import run_dirs
    from atlas_lightning.run.facts import resume_path

    start = resume_path(cfg, run_dirs(cfg)["checkpoints"])
    notes = [note for note in start.notes if "resuming from" not in note]
    head = f"resuming from {start.resume} (verified)" if start.resume is not None else "a fresh start"
    return "; ".join([head, *notes])


def check_plan(cfg, card_gib: Optional[float]) -> str:
    from atlas_lightning.planning import make_plan

    plan = make_plan(cfg, card_gib=card_gib)
    if not plan.ok:
        raise PreflightError("plan refused: " + " | ".join(plan.refusals))
    update = plan.phase("update_actor")
    if plan.device == "cpu":
        return f"CPU run (no card to fit): update {update.tensors / 2**30:.2f} GiB of tensors at {update.tokens:,} tokens"
    return (f"peak {max(p.card for p in plan.phases if p.cards != 'serving cards') / 2**30:.1f} GiB a card "
            f"of {plan.card_bytes / 2**30:.0f} (update {update.card / 2**30:.1f} GiB at {update.tokens:,} tokens)")


def check_environment(cfg, cpu: bool) -> str:
    """The machine's side (``run/environment.check_machine``: cards, W&B key), vLLM found when
    the engine is vLLM, every folder the run writes writable (``facts.check_writable``)."""
    from atlas_lightning.config import run_dirs
    from atlas_lightning.run.environment import check_machine
    from atlas_lightning.run.facts import check_writable

    notes = check_machine(cfg, count_gpus=not cpu)
    if cpu and cfg.trainer.accelerator in ("gpu", "cuda"):
        notes.insert(0, f"GPU count NOT checked (--cpu-preflight: {cfg.trainer.devices} wanted a node)")
    if cfg.rollout.engine in ("vllm", "vllm-server"):
        if importlib.util.find_spec("vllm") is None:
            raise PreflightError(f"rollout.engine={cfg.rollout.engine}: vllm is not installed in {sys.prefix}")
        notes.append("vllm found")
    check_writable(run_dirs(cfg))  # fit's own check of every folder the run writes
    return "; ".join(notes) or "ok"


# ----------------------------------------------------------------------------- running


def run_preflight(overrides: list[str], *, cpu: bool = False, config_dir: Optional[str] = None,
                  card_gib: Optional[float] = None, echo: Callable[[str], None] = print) -> list[Check]:
    """Run the checks in order (module doc); a failed ``config`` stops the rest, other failures
    do not (every problem is reported at once)."""
    results: list[Check] = []

    def run(name: str, fn: Callable[[], str]) -> bool:
        started = time.monotonic()
        try:
            detail, ok = fn(), True
        except Exception as err:  # every failure is reported by name, nothing is raised
            detail, ok = f"{err}" if isinstance(err, (PreflightError, ConfigError)) else f"{type(err).__name__}: {err}", False
        check = Check(name, ok, detail, time.monotonic() - started)
        results.append(check)
        echo(f"[{'ok' if ok else 'FAIL':>4}] {name:<12} {detail} ({check.seconds:.1f} s)")
        return ok

    holder: dict = {}

    def composed() -> str:
        holder["cfg"] = compose(overrides, user_config_dir=config_dir)
        cfg = holder["cfg"]
        return f"{cfg.name} (layout {cfg.layout.mode} {cfg.layout.gpus} cards, {cfg.trainer.devices} a node)"

    if not run("config", composed):
        return results
    cfg = holder["cfg"]
    run("callbacks", lambda: check_callbacks(cfg))
    run("reward", lambda: check_reward(cfg))
    run("model", lambda: check_model(cfg))
    run("data", lambda: check_data(cfg))
    run("adapters", lambda: check_adapters(cfg))
    run("resume", lambda: check_resume(cfg))
    run("plan", lambda: check_plan(cfg, card_gib))
    run("environment", lambda: check_environment(cfg, cpu))
    return results


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="atlas-lightning preflight", description=__doc__.split("\n")[0])
    parser.add_argument("overrides", nargs="*", help="hydra overrides, e.g. experiment=r28-continued-cost-8gpu-n32")
    parser.add_argument("--cpu-preflight", action="store_true",
                        help="check a GPU run on a CPU machine: the GPU count is not checked")
    parser.add_argument("--card-gib", type=float, default=None, help="memory of one card in GiB (default: plan.card_gib, 80)")
    parser.add_argument("--config-dir", default=None)
    args = parser.parse_intermixed_args(argv)  # overrides before and after the options, as hydra reads them
    cpu = args.cpu_preflight
    started = time.monotonic()
    results = run_preflight(args.overrides, cpu=cpu, config_dir=args.config_dir, card_gib=args.card_gib)
    failed = [c.name for c in results if not c.ok]
    verdict = f"pre-flight FAILED: {', '.join(failed)}" if failed else "pre-flight passed"
    print(f"{verdict} ({time.monotonic() - started:.1f} s{'; CPU pre-flight' if cpu else ''})")
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
