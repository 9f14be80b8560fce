"""Pre-flight: everything a launch needs, checked in seconds, before any model or engine starts.

    atlas-lightning preflight experiment=<run> [overrides] [--cpu-preflight] [--card-gib G]
    (also python -m atlas_lightning.run.preflight ...)

Checks, in order (each prints one line; the exit code is 0 when all pass, 2 otherwise):

1. ``config``: the config composes and validates (an unknown key or bad value is named);
   ``callbacks``: every configured callback builds from its arguments, as ``fit`` builds it
   (``run/wiring.build_callbacks``: names and types checked, an injected fault that would strike);
2. ``model``: ``model.path`` is a local folder with a readable ``config.json`` of a known
   family, a tokenizer and weight files (none is loaded);
3. ``data``: the train and validation splits of every benchmark load (``data.loader.load_split``:
   a bad file, row or field is named);
4. ``adapters``: the starting adapters (``trainer.init_from``'s ``actor``/``critic``, or
   ``model.actor_adapter``/``critic_adapter``) are PEFT folders whose base (``atlas_base.json``,
   when present) has this base's config fields, and whose tensors (read from the safetensors
   header only) have the shapes their own ``adapter_config.json`` (rank, target modules, per-
   module ranks) and this base imply; the critic's value head too (``value_head.safetensors``,
   or a module of ``modules_to_save``). Each adapter trains its folder's LoRA shape, actor and
   critic alike, whatever ``model.lora`` says: the line printed names the shape, and says so
   when the config's differs. Fresh adapters print the shape the config gives them. The
   weights fingerprint needs the weights and is checked when the trainer loads them
   (``models/adapters.py``);
5. ``plan``: ``planning.make_plan`` passes (layouts and memory; cards of ``plan.card_gib``
   GiB, default 80, or ``--card-gib``);
6. ``environment``: enough GPUs on this node for ``trainer.devices``, vLLM importable when the
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
import re
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

    folder = Path(cfg.model.path)
    check_model_folder(folder)  # the one check fit, validate, memory-check and plan make
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
    from atlas_lightning.questions.loader import check_subset_columns, load_split
    from atlas_lightning.run.facts import check_data_root

    check_data_root(cfg.data)  # fit's own check of the key
    counts, loaded = [], {}
    for split in (cfg.data.train_split, cfg.data.val_split):
        questions = loaded[split] = load_split(cfg.data, split)
        if not questions:
            raise PreflightError(f"data.root={cfg.data.root}: split {split} has no questions")
        counts.append(f"{split} {len(questions)}")
    check_subset_columns(cfg.data, loaded)
    return f"{cfg.data.root}: {', '.join(counts)} questions ({', '.join(cfg.data.benchmarks)})"


def starting_adapters(cfg) -> dict[str, Path]:
    """The adapter folders the trainer will start from (``store.lora_shapes.starting_adapters``,
    as ``PPOModule`` resolves them)."""
    from atlas_lightning.store.lora_shapes import starting_adapters as resolve

    return {role: Path(folder) for role, folder in resolve(cfg).items()}


_LORA_KEY = re.compile(r"layers\.(\d+)\.(?:.*\.)?([A-Za-z0-9_]+)\.lora_([AB])\.weight$")


def check_adapter(cfg, shape, role: str, folder: Path) -> str:
    """One starting adapter against this base (module doc, check 4): its LoRA shape is its own
    ``adapter_config.json``'s (the trainer builds the adapter with it), its tensors must have the
    shapes that LoRA and this base imply. Returns the line pre-flight prints: the shape it will
    train, and where ``model.lora`` (or ``model.critic_lora``) says otherwise, that the folder's wins."""
    from atlas_lightning.planning.shapes import safetensors_header
    from atlas_lightning.run.adapter_files import check_adapter_base, target_names
    from atlas_lightning.store.lora_shapes import (AdapterConfigError, config_lora_shape, read_adapter_config,
                                                   shape_from_adapter_config, starting_adapter_source)

    source = starting_adapter_source(cfg, role)
    config_file = folder / "adapter_config.json"
    try:
        saved = read_adapter_config(folder)
        lora = shape_from_adapter_config(saved, str(config_file))
    except AdapterConfigError as err:
        raise PreflightError(f"{source}: {err}") from None
    check_adapter_base(shape, folder, source)

    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise PreflightError(f"{source}: {folder} has no adapter_model.safetensors")
    header = safetensors_header(weights)
    seen, found_modules = 0, set()
    for key, info in header.items():
        match = _LORA_KEY.search(key)
        if not match:
            continue
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        if layer >= shape.num_layers:
            raise PreflightError(f"{source}: {weights} has {key}, but the base has {shape.num_layers} layers")
        linear = {lin.name: lin for lin in shape.linears(shape.layer_types[layer])}.get(module)
        if linear is None:
            raise PreflightError(f"{source}: {weights} has {key}: the base's layer {layer} has no linear {module}")
        rank = _module_rank(lora, key)
        expect = [rank, linear.in_features] if which == "A" else [linear.out_features, rank]
        if list(info.get("shape", [])) != expect:
            raise PreflightError(f"{source}: {weights} {key} has shape {info.get('shape')}, this base and the "
                                 f"folder's r={rank} imply {expect} (a different base model, or tensors that do "
                                 f"not match their own adapter_config.json)")
        seen += 1
        found_modules.add(module)
    expected_modules = {lin.name for t in set(shape.layer_types) for lin in shape.adapted_linears(t, lora.target_modules)}
    if isinstance(lora.target_modules, str) and lora.target_modules != "all-linear":
        expected_modules = found_modules  # a regex: peft matches it on full names; the tensors say what it matched
    if found_modules != expected_modules:
        raise PreflightError(f"{source}: {weights} adapts {sorted(found_modules)}, its adapter_config.json's "
                             f"target_modules={saved.get('target_modules')!r} mean {sorted(expected_modules)} on this base")
    count = 2 * sum(len(shape.adapted_linears(t, sorted(found_modules))) for t in shape.layer_types)
    if seen != count and not saved.get("layers_to_transform"):
        raise PreflightError(f"{source}: {weights} holds {seen} LoRA tensors, this base and target modules need {count}")
    head = _check_value_head(shape, folder, saved, header, source) if role == "critic" else ""
    line = f"{role} {folder}: {lora.describe()}, {seen} tensors{head}"
    configured = config_lora_shape(cfg, role)
    if ((configured.rank, configured.alpha, target_names(configured, shape))
            != (lora.rank, lora.alpha, target_names(lora, shape))):
        line += f" (the folder's shape; {configured.source} says {configured.describe()})"
    return line


def _module_rank(lora, key: str) -> int:
    """The rank peft gives the module of ``key``: ``rank_pattern``'s (a key matching the module
    path's end, as peft matches it) or the adapter's ``r``."""
    module = key.split(".lora_")[0]
    for pattern, rank in lora.rank_pattern.items():
        if re.search(rf"(^|\.){pattern}$", module):
            return int(rank)
    return lora.rank


def _check_value_head(shape, folder: Path, saved: dict, header: dict, source: str) -> str:
    """The critic's value head: ``value_head.safetensors``, or a ``(1, hidden)`` module among
    ``modules_to_save`` inside ``adapter_model.safetensors`` (what ``models/adapters.py`` loads)."""
    from atlas_lightning.planning.shapes import safetensors_header

    head = folder / "value_head.safetensors"
    if head.is_file():
        shapes = {k: v.get("shape") for k, v in safetensors_header(head).items()}
        if shapes.get("weight") != [1, shape.hidden_size]:
            raise PreflightError(f"{source}: {head} weight has shape {shapes.get('weight')}, expected "
                                 f"[1, {shape.hidden_size}]")
        return ""
    names = saved.get("modules_to_save") or []
    names = {str(n).split(".")[-1] for n in ([names] if isinstance(names, str) else names)}
    weights = {k: v.get("shape") for k, v in header.items()
               if ".lora_" not in k and k.rpartition(".")[0].split(".")[-1] in names and k.endswith(".weight")}
    if not weights:
        raise PreflightError(f"{source}: {folder} has no value_head.safetensors and no value head among "
                             f"adapter_config.json's modules_to_save (the critic's value head)")
    if len(weights) != 1 or next(iter(weights.values())) != [1, shape.hidden_size]:
        raise PreflightError(f"{source}: {folder}'s modules_to_save hold {weights}; a value head is a weight "
                             f"[1, {shape.hidden_size}]")
    return f", value head {next(iter(weights))} (modules_to_save)"


def check_adapters(cfg) -> str:
    from atlas_lightning.planning.shapes import read_model_shape

    from atlas_lightning.store.lora_shapes import ROLES, config_lora_shape

    folders = starting_adapters(cfg)
    shape = read_model_shape(cfg.model.path) if folders else None
    return "; ".join(check_adapter(cfg, shape, role, folders[role]) if role in folders
                     else f"{role} fresh: {config_lora_shape(cfg, role).describe()} ({config_lora_shape(cfg, role).source})"
                     for role in ROLES)


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
    run("model", lambda: check_model(cfg))
    run("data", lambda: check_data(cfg))
    run("adapters", lambda: check_adapters(cfg))
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
    args = parser.parse_args(argv)
    cpu = args.cpu_preflight
    started = time.monotonic()
    results = run_preflight(args.overrides, cpu=cpu, config_dir=args.config_dir, card_gib=args.card_gib)
    failed = [c.name for c in results if not c.ok]
    verdict = f"pre-flight FAILED: {', '.join(failed)}" if failed else "pre-flight passed"
    print(f"{verdict} ({time.monotonic() - started:.1f} s{'; CPU pre-flight' if cpu else ''})")
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
