"""The LoRA shape each adapter of a run trains, and the folders it starts from.

A run trains two adapters on one base, ``actor`` and ``critic``; each may have its own shape
(rank, alpha, target modules). Where an adapter starts from a PEFT folder (another run's
``global_step_N/{actor,critic}/lora_adapter``) its shape is the folder's own, read from its
``adapter_config.json``: the trainer takes the folder as it is, whatever ``model.lora`` says.
An adapter that starts fresh takes the config's: ``model.lora`` for the actor,
``model.critic_lora``'s fields over ``model.lora``'s for the critic (a null field is
``model.lora``'s; all are by default).

Which folders: ``model.actor_adapter`` / ``model.critic_adapter``, else those of
``trainer.init_from`` (the critic only with ``trainer.init_critic``): ``starting_adapters``,
the one place this is decided (the model builder, ``plan``, memory-check, pre-flight and the
engines' ``max_lora_rank`` all read it).

Pure Python (JSON only): nothing here imports torch or peft. Errors (``AdapterConfigError``)
name the file and the field.

Who calls it: ``ppo.module`` (the starting folders), ``models.build`` (through it), ``planning``
(per-adapter LoRA states and activations), ``run.preflight`` (checks and prints the shapes),
``rollout.factory`` / ``rollout.separate`` (the actor's rank sizes the engines' LoRA slots).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from atlas_lightning.errors import InputError
from atlas_lightning.store.files import read_json_object

ROLES = ("actor", "critic")
CONFIG_FILE = "adapter_config.json"


class AdapterError(InputError):
    """A damaged adapter folder (unreadable or truncated file, bad config or identity file,
    non-finite weights); the message names the folder and the file."""


class AdapterConfigError(AdapterError):
    """An ``adapter_config.json`` that cannot be read or gives no LoRA shape; names file and field.
    The one reader of that file: ``read_adapter_config`` then ``shape_from_adapter_config``."""


@dataclass(frozen=True)
class LoraShape:
    """One adapter's LoRA: ``rank`` and ``alpha`` (peft's ``r`` and ``lora_alpha``), the
    ``target_modules`` (``"all-linear"``, a tuple of module names, or peft's regex string),
    per-module overrides (``rank_pattern``, ``alpha_pattern``) and where it was read
    (``source``: ``model.lora``, ``model.critic_lora`` or the folder's ``adapter_config.json``)."""

    rank: int
    alpha: float
    target_modules: Union[str, tuple[str, ...]] = "all-linear"
    source: str = "model.lora"
    rank_pattern: dict = field(default_factory=dict, compare=False)
    alpha_pattern: dict = field(default_factory=dict, compare=False)
    use_rslora: bool = False
    #: The PEFT folder it starts from (None: fresh).
    folder: Optional[str] = None

    @property
    def max_rank(self) -> int:
        """The largest rank of any module (what an engine's ``max_lora_rank`` must hold)."""
        return max([self.rank] + [int(r) for r in self.rank_pattern.values()])

    def describe(self) -> str:
        """``r64 alpha 128, all-linear`` / ``r16 alpha 32, q_proj,v_proj``: for logs and pre-flight."""
        targets = self.target_modules if isinstance(self.target_modules, str) else ",".join(self.target_modules)
        alpha = int(self.alpha) if float(self.alpha).is_integer() else self.alpha
        extra = " (per-module ranks: rank_pattern)" if self.rank_pattern else ""
        return f"r{self.rank} alpha {alpha}, {targets}{extra}"


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    node = cfg
    for part in key.split("."):
        if node is None:
            return default
        node = node.get(part) if hasattr(node, "get") else getattr(node, part, None)
    return default if node is None else node


def starting_adapters(cfg: Any) -> dict[str, str]:
    """``{role: folder}`` of the adapters that start from a PEFT folder (module doc); roles that
    start fresh are absent."""
    actor, critic = _get(cfg, "model.actor_adapter"), _get(cfg, "model.critic_adapter")
    init_from = _get(cfg, "trainer.init_from")
    if init_from:
        step = Path(str(init_from))
        actor = actor or str(step / "actor" / "lora_adapter")
        if _get(cfg, "trainer.init_critic", True):
            critic = critic or str(step / "critic" / "lora_adapter")
    return {role: str(folder) for role, folder in (("actor", actor), ("critic", critic)) if folder}


def starting_adapter_source(cfg: Any, role: str) -> str:
    """The config key that names ``role``'s starting folder (for messages)."""
    return f"model.{role}_adapter" if _get(cfg, f"model.{role}_adapter") else "trainer.init_from"


def read_adapter_config(folder: str | Path) -> dict:
    """``folder/adapter_config.json`` as a dict; ``AdapterConfigError`` naming the file."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise AdapterConfigError(f"{folder}: no {CONFIG_FILE} (not a PEFT adapter folder)")
    return read_json_object(path, AdapterConfigError, folder)


def shape_from_adapter_config(saved: dict, where: str) -> LoraShape:
    """The ``LoraShape`` a PEFT ``adapter_config.json`` (as a dict) describes; ``where`` names it."""
    if saved.get("peft_type", "LORA") != "LORA":
        raise AdapterConfigError(f"{where}: peft_type={saved.get('peft_type')!r}, expected 'LORA'")
    _check_plain_lora(saved, where)
    rank, alpha = saved.get("r"), saved.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise AdapterConfigError(f"{where}: field r={rank!r} is not a positive integer")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise AdapterConfigError(f"{where}: field lora_alpha={alpha!r} is not a positive number")
    targets = saved.get("target_modules")
    if isinstance(targets, (list, tuple)) and targets and all(isinstance(t, str) and t for t in targets):
        # peft writes the names it matched; a dotted entry names a module path: its leaf is the linear
        targets = tuple(sorted({t.split(".")[-1] for t in targets}))
    elif not (isinstance(targets, str) and targets):
        raise AdapterConfigError(f"{where}: field target_modules={targets!r} names no module")
    elif targets != "all-linear":
        try:  # a string is peft's regex, full-matched against every module's name
            re.compile(targets)
        except re.error as err:
            raise AdapterConfigError(f"{where}: field target_modules={targets!r} is not a regular expression "
                                     f"({err})") from None
    patterns = {}
    for key in ("rank_pattern", "alpha_pattern"):
        value = saved.get(key) or {}
        if not isinstance(value, dict):
            raise AdapterConfigError(f"{where}: field {key}={value!r} must be an object")
        patterns[key] = dict(value)
    return LoraShape(rank=rank, alpha=float(alpha), target_modules=targets, source=where,
                     use_rslora=bool(saved.get("use_rslora", False)), **patterns)


#: peft LoRA variants neither side trains or serves as plain LoRA, by ``adapter_config.json`` field
#: (vLLM's ``PEFTHelper`` refuses each when the adapter reaches the engine; DoRA keeps magnitudes
#: the build has no place for; a PiSSA/OLoRA/CorDA/LoftQ init rewrites the base when peft builds it).
UNSUPPORTED_VARIANTS = {
    "use_dora": "DoRA", "lora_bias": "LoRA bias", "layer_replication": "layer replication",
    "alora_invocation_tokens": "activated LoRA", "use_qalora": "QALoRA", "use_bdlora": "block-diagonal LoRA",
}
#: ``init_lora_weights`` values that only draw the first adapter (any other string rewrites the base).
PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")


def _check_plain_lora(saved: dict, where: str) -> None:
    """The folder is a plain LoRA adapter (``UNSUPPORTED_VARIANTS``, ``bias`` "none",
    ``init_lora_weights`` a boolean or one of ``PLAIN_INITS``)."""
    used = [name for field, name in UNSUPPORTED_VARIANTS.items() if saved.get(field)]
    if saved.get("bias", "none") not in (None, "none"):
        used.append(f"trained biases (bias={saved.get('bias')!r})")
    init = saved.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in PLAIN_INITS:
        used.append(f"init_lora_weights={init!r}, which rewrites the base weights when peft builds it")
    if used:
        raise AdapterConfigError(f"{where}: the adapter uses {', '.join(used)}; the trainer and the engines take "
                                 f"plain LoRA only (convert it, or start a fresh adapter)")


def read_lora_shape(folder: str | Path) -> LoraShape:
    """The LoRA shape of the PEFT folder ``folder`` (from its ``adapter_config.json``)."""
    shape = shape_from_adapter_config(read_adapter_config(folder), str(Path(folder) / CONFIG_FILE))
    return LoraShape(**{**shape.__dict__, "folder": str(folder)})


LORA_FIELDS = ("rank", "alpha", "dropout", "target_modules")


def fresh_lora_spec(model_cfg: Any, role: str) -> dict:
    """``{"rank", "alpha", "dropout", "target_modules"}`` a fresh ``role`` adapter is built with
    (the model builder's LoRA spec): ``model.lora``'s; for the critic, ``model.critic_lora``'s
    fields that are not null over it."""
    spec = {key: _get(model_cfg, f"lora.{key}") for key in LORA_FIELDS}
    critic = _get(model_cfg, "critic_lora") if role == "critic" else None
    if critic is not None:
        spec.update({key: _get(critic, key) for key in LORA_FIELDS if _get(critic, key) is not None})
    targets = spec["target_modules"]
    spec["target_modules"] = "all-linear" if targets is None else targets if isinstance(targets, str) else list(targets)
    spec["dropout"] = float(spec["dropout"] or 0.0)
    return spec


def config_lora_shape(cfg: Any, role: str) -> LoraShape:
    """The shape a fresh ``role`` adapter takes from the config (module doc)."""
    model = _get(cfg, "model")
    spec = fresh_lora_spec(model, role)
    critic = _get(model, "critic_lora") if role == "critic" else None
    given = critic is not None and any(_get(critic, key) is not None for key in LORA_FIELDS)
    source = "model.critic_lora" if given else "model.lora"
    targets = spec["target_modules"]
    if not isinstance(targets, str):
        targets = tuple(sorted(str(t) for t in targets))
    return LoraShape(rank=int(spec["rank"]), alpha=float(spec["alpha"]), target_modules=targets, source=source)


def lora_shapes(cfg: Any) -> dict[str, LoraShape]:
    """``{"actor": LoraShape, "critic": LoraShape}``: what this run trains (module doc).
    ``AdapterConfigError`` when a starting folder's config is missing or unreadable."""
    folders = starting_adapters(cfg)
    return {role: read_lora_shape(folders[role]) if role in folders else config_lora_shape(cfg, role)
            for role in ROLES}


def lora_shapes_or_config(cfg: Any) -> tuple[dict[str, LoraShape], list[str]]:
    """As ``lora_shapes``, but a starting folder that cannot be read gives the config's shape
    instead, with a note saying so (for ``plan``, which sizes memory and must not stop on a
    folder that pre-flight reports anyway): ``(shapes, notes)``."""
    folders, shapes, notes = starting_adapters(cfg), {}, []
    for role in ROLES:
        shapes[role] = config_lora_shape(cfg, role)
        if role in folders:
            try:
                shapes[role] = read_lora_shape(folders[role])
            except AdapterConfigError as err:
                notes.append(f"{role} LoRA planned from {shapes[role].source} ({shapes[role].describe()}): its "
                             f"starting adapter cannot be read ({err})")
    return shapes, notes
