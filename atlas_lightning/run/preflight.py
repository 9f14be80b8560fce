"""Pre-flight: everything a launch needs, checked in seconds, before any model or engine starts.

    python -m atlas_lightning.run.preflight experiment=<run> [overrides] [--cpu-preflight] [--card-gib G]

Checks, in order (each prints one line; the exit code is 0 when all pass, 2 otherwise):

1. ``config``: the config composes and validates (an unknown key or bad value is named);
2. ``model``: ``model.path`` is a local folder with a readable ``config.json`` of a known
   family, a tokenizer and weight files (none is loaded);
3. ``data``: the train and validation splits of every benchmark load (``data.loader.load_split``:
   a bad file, row or field is named);
4. ``adapters``: the starting adapters (``trainer.init_from``'s ``actor``/``critic``, or
   ``model.actor_adapter``/``critic_adapter``) are PEFT folders whose rank, alpha and target
   modules are this run's, whose base (``atlas_base.json``, when present) has this base's
   config fields, and whose tensors (read from the safetensors header only) have the shapes
   this base and rank imply; the critic's value head too. The weights fingerprint needs the
   weights and is checked when the trainer loads them (``models/adapters.py``);
5. ``plan``: ``planning.make_plan`` passes (layouts and memory; cards of ``plan.card_gib``
   GiB, default 80, or ``--card-gib``);
6. ``environment``: enough GPUs on this node for ``trainer.devices``, vLLM importable when the
   engine is vLLM (found, not imported), the output root writable, a W&B key when logging online.

``--cpu-preflight`` relaxes only the GPU count, and says so: it lets a GPU run's real config be
checked on a CPU machine (tests swap in the tiny model; the launchers pass it when their
``ATLAS_CPU_PREFLIGHT=1`` is set).

Who calls it: every ``launch/*.sh`` before its run, tests.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

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


def check_data(cfg) -> str:
    from atlas_lightning.questions.loader import load_split

    counts = []
    for split in (cfg.data.train_split, cfg.data.val_split):
        questions = load_split(cfg.data, split)
        if not questions:
            raise PreflightError(f"data.root={cfg.data.root}: split {split} has no questions")
        counts.append(f"{split} {len(questions)}")
    return f"{cfg.data.root}: {', '.join(counts)} questions ({', '.join(cfg.data.benchmarks)})"


def starting_adapters(cfg) -> dict[str, Path]:
    """The adapter folders the trainer will start from, as ``PPOModule`` resolves them."""
    actor, critic = cfg.model.actor_adapter, cfg.model.critic_adapter
    if cfg.trainer.init_from:
        step = Path(cfg.trainer.init_from)
        actor = actor or str(step / "actor" / "lora_adapter")
        if cfg.trainer.init_critic:
            critic = critic or str(step / "critic" / "lora_adapter")
    return {name: Path(folder) for name, folder in (("actor", actor), ("critic", critic)) if folder}


_LORA_KEY = re.compile(r"layers\.(\d+)\.(?:.*\.)?([A-Za-z0-9_]+)\.lora_([AB])\.weight$")


def check_adapter(cfg, shape, role: str, folder: Path) -> str:
    """One starting adapter against this run's LoRA settings and base (module doc, check 4)."""
    from atlas_lightning.planning.shapes import safetensors_header

    source = "trainer.init_from" if cfg.trainer.init_from and not cfg.model.get(f"{role}_adapter") else f"model.{role}_adapter"
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise PreflightError(f"{source}: {folder} has no adapter_config.json (not a PEFT adapter folder)")
    saved = json.loads(config_file.read_text())
    lora = cfg.model.lora
    wanted = {"peft_type": "LORA", "r": lora.rank, "lora_alpha": lora.alpha}
    for key, value in wanted.items():
        found = saved.get(key, "LORA" if key == "peft_type" else None)
        if (float(found) != float(value)) if key == "lora_alpha" and found is not None else found != value:
            config_key = {"r": "model.lora.rank", "lora_alpha": "model.lora.alpha"}.get(key, key)
            raise PreflightError(f"{source}: {config_file} has {key}={found!r}, this run has {config_key}={value!r}")
    expected_modules = shape.linear_names() if lora.target_modules == "all-linear" else set(lora.target_modules)
    found_modules = saved.get("target_modules")
    # peft writes the expanded list of module paths (model.layers.0.self_attn.q_proj): compare leaf names
    found_set = (shape.linear_names() if found_modules == "all-linear"
                 else {str(name).split(".")[-1] for name in ([found_modules] if isinstance(found_modules, str)
                                                             else found_modules or [])})
    if found_set != expected_modules:
        raise PreflightError(f"{source}: {config_file} adapts {sorted(found_set)}, this run's "
                             f"model.lora.target_modules={lora.target_modules!r} means {sorted(expected_modules)}")
    _check_adapter_base(shape, folder, source)

    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise PreflightError(f"{source}: {folder} has no adapter_model.safetensors")
    header = safetensors_header(weights)
    seen = 0
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
        expect = [lora.rank, linear.in_features] if which == "A" else [linear.out_features, lora.rank]
        if list(info.get("shape", [])) != expect:
            raise PreflightError(f"{source}: {weights} {key} has shape {info.get('shape')}, this base and rank "
                                 f"imply {expect} (a different base model or rank)")
        seen += 1
    count = 2 * sum(len(shape.adapted_linears(t, lora.target_modules)) for t in shape.layer_types)
    if seen != count:
        raise PreflightError(f"{source}: {weights} holds {seen} LoRA tensors, this base and target modules need {count}")
    if role == "critic":
        head = folder / "value_head.safetensors"
        if not head.is_file():
            raise PreflightError(f"{source}: {folder} has no value_head.safetensors (the critic's value head)")
        shapes = {k: v.get("shape") for k, v in safetensors_header(head).items()}
        if shapes.get("weight") != [1, shape.hidden_size]:
            raise PreflightError(f"{source}: {head} weight has shape {shapes.get('weight')}, expected "
                                 f"[1, {shape.hidden_size}]")
    return f"{role} {folder} (r{lora.rank}, alpha {lora.alpha}, {seen} tensors)"


def _check_adapter_base(shape, folder: Path, source: str) -> None:
    """``atlas_base.json``'s config fields against this base's ``config.json`` (shared fields only)."""
    identity_file = folder / "atlas_base.json"
    if not identity_file.is_file():
        return  # an adapter from elsewhere: the tensor shapes below are the check
    from atlas_lightning.models.identity import SHAPE_FIELDS

    theirs = json.loads(identity_file.read_text()).get("config", {})
    mine = _base_config_fields(shape)
    for key in SHAPE_FIELDS:
        if key in theirs and key in mine and _normal(key, theirs[key]) != _normal(key, mine[key]):
            raise PreflightError(f"{source}: {folder} was trained on a different base: {key} is {theirs[key]!r} "
                                 f"there, {mine[key]!r} in model.path's config.json")


def _normal(key: str, value: Any) -> Any:
    if key == "model_type" and isinstance(value, str):
        return value.removesuffix("_text")
    return list(value) if isinstance(value, (list, tuple)) else value


def _base_config_fields(shape) -> dict[str, Any]:
    raw = json.loads(Path(shape.source).read_text())
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    return {**text, "model_type": text.get("model_type", raw.get("model_type")),
            "tie_word_embeddings": raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))}


def check_adapters(cfg) -> str:
    from atlas_lightning.planning.shapes import read_model_shape

    folders = starting_adapters(cfg)
    if not folders:
        return "fresh adapters (nothing to start from)"
    shape = read_model_shape(cfg.model.path)
    return "; ".join(check_adapter(cfg, shape, role, folder) for role, folder in folders.items())


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
    notes = []
    t = cfg.trainer
    if t.accelerator in ("gpu", "cuda"):
        if cpu:
            notes.append(f"GPU count NOT checked (--cpu-preflight: {t.devices} wanted a node)")
        else:
            found = _gpu_count()
            if found < t.devices:
                raise PreflightError(f"trainer.devices={t.devices} GPUs a node wanted, {found} visible here "
                                     f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
            notes.append(f"{found} GPUs visible")
    if cfg.rollout.engine in ("vllm", "vllm-server"):
        if importlib.util.find_spec("vllm") is None:
            raise PreflightError(f"rollout.engine={cfg.rollout.engine}: vllm is not installed in {sys.prefix}")
        notes.append("vllm found")
    root = Path(cfg.paths.root)
    existing = next((p for p in (root, *root.parents) if p.exists()), None)
    if existing is None or not os.access(existing, os.W_OK):
        raise PreflightError(f"paths.root={root}: not writable (nearest existing folder: {existing})")
    if cfg.logger.mode == "online" and not os.environ.get("WANDB_API_KEY"):
        raise PreflightError("logger.mode=online but WANDB_API_KEY is not set")
    return "; ".join(notes) or "ok"


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


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
    run("model", lambda: check_model(cfg))
    run("data", lambda: check_data(cfg))
    run("adapters", lambda: check_adapters(cfg))
    run("plan", lambda: check_plan(cfg, card_gib))
    run("environment", lambda: check_environment(cfg, cpu))
    return results


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m atlas_lightning.run.preflight", description=__doc__.split("\n")[0])
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
