"""A configured callback's arguments against what its class takes, before it is built.

Hydra's ``instantiate`` passes a ``callbacks.<name>`` entry's values as they are: ``overlap:
maybe`` reaches ``ValidationCallback`` as a string, which is true; ``background: 'no'`` too;
``every_n_steps: '5'`` is compared with an int only mid-run. ``check_callback_arguments``
refuses, naming the key, an argument its target does not take and a value that is not of the
type the target's annotation names (``bool``, ``int``, ``float``, ``str``, a path, a list, a
mapping, a ``Literal``, ``Optional`` and unions of these; anything else is left to the target,
which checks its own ranges and choices when ``build_callbacks`` builds it, also before
anything is written).

An argument the shipped entry takes from a run key (``repo_type: ${hub.repo_type}``, ``artifacts:
${paths.artifacts}``, ``total_steps: ${trainer.total_steps}``) is also held to that key's rule
(``constraints.CONSTRAINTS``) when it is set on the callback itself: the key's rule holds for the
value whichever way it arrives (``callbacks.hub.repo_type=nonsense``, an empty folder, a
``run_id`` with a slash, ``total_steps: 0`` had passed every check); a folder (``paths.*``) must
also be writable, and a step count or run name must equal the run's own (``MUST_EQUAL``).

Who calls it: ``run/wiring.build_callbacks``.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from atlas_lightning.config import ConfigError
from atlas_lightning.constraints import CONSTRAINTS, Violation


def check_callback_arguments(name: str, target: Any, arguments: Mapping[str, Any],
                             cfg: Optional[DictConfig] = None) -> None:
    """``ConfigError`` naming ``callbacks.<name>.<key>`` for an argument ``target`` (a class or
    factory) does not take, or whose value is not of its annotated type, or breaks the rule of
    the run key the shipped entry takes it from (module doc). ``arguments``: the entry's values,
    resolved, without hydra's own keys (``_target_``, ...); ``cfg``: the run's config, whose
    value of a run key an argument passes as it is (checked there: ``config.validate``,
    ``run/facts.check_writable``) or must equal (``MUST_EQUAL``)."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # a builtin without one: nothing to check against
        return
    params = signature.parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    hints = _hints(target)
    what = getattr(target, "__qualname__", str(target))
    sources = shipped_sources().get(name, {})
    for key, value in arguments.items():
        if key not in params and not takes_any:
            named = ", ".join(k for k, p in params.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL)
            raise ConfigError(f"callbacks.{name}.{key}: {what} takes no argument {key!r} (it takes: {named})")
        hint = hints.get(key)
        if hint is not None and not fits(value, hint):
            raise ConfigError(f"callbacks.{name}.{key}={value!r}: {what} takes {describe(hint)} for {key}, "
                              f"got {type(value).__name__}")
        source = sources.get(key)
        run_value = OmegaConf.select(cfg, source) if source is not None and cfg is not None else _UNSET
        if source is None or value == run_value:  # the run key's own value: checked as that key
            continue
        _check_as_its_source(f"callbacks.{name}.{key}", value, source)
        if source in MUST_EQUAL and run_value is not _UNSET:
            raise ConfigError(f"callbacks.{name}.{key}={value!r} differs from {source}={run_value!r}, which the run "
                              f"follows: set {source} instead")


_UNSET = object()


#: Run keys a callback's argument taken from them must equal: a progress bar, a last validation or
#: a last checkpoint counted to another step than the run trains to, or records filed under
#: another run's name, would be wrong without a word.
MUST_EQUAL = ("trainer.total_steps", "name")


def _check_as_its_source(key: str, value: Any, source: str) -> None:
    """``value`` of callback argument ``key`` against the rule of run key ``source``, and, for a
    run folder (``paths.*``), writable as ``run/facts.check_writable`` checks those (a figures
    folder under ``/proc`` had ended the first step in a traceback)."""
    from atlas_lightning.run.facts import unwritable

    rule = CONSTRAINTS.get(source)
    try:
        if rule is not None:
            rule(value)
    except Violation as err:
        raise ConfigError(f"{key}={value!r}: {err} (the rule of {source}, which the shipped entry passes here)") from None
    reason = unwritable(Path(value)) if source.startswith("paths.") and isinstance(value, str) else None
    if reason:
        raise ConfigError(f"{key}={value}: {reason} (a folder the run writes, as {source})")


@functools.lru_cache(maxsize=1)
def shipped_sources() -> dict[str, dict[str, str]]:
    """Per shipped callback entry (``conf/callbacks/default.yaml``), the run key each argument is
    interpolated from (``{"hub": {"repo_type": "hub.repo_type", ...}, ...}``); literal values and
    anything else are left out."""
    from atlas_lightning.config import config_dir

    shipped = OmegaConf.to_container(OmegaConf.load(Path(config_dir()) / "callbacks" / "default.yaml"),
                                     resolve=False)
    sources: dict[str, dict[str, str]] = {}
    for entry, spec in shipped.items():
        for key, value in (spec or {}).items():
            match = re.fullmatch(r"\$\{([A-Za-z_][A-Za-z0-9_.]*)\}", value) if isinstance(value, str) else None
            if match:
                sources.setdefault(entry, {})[key] = match.group(1)
    return sources


def _hints(target: Any) -> dict[str, Any]:
    """The resolved annotations of ``target``'s parameters (its ``__init__``'s for a class);
    ``{}`` where they cannot be resolved (then no type is checked)."""
    function = target.__init__ if isinstance(target, type) else target
    try:
        return typing.get_type_hints(function)
    except Exception:  # annotations naming what the module does not import: the target checks its own
        return {}


def fits(value: Any, hint: Any) -> bool:
    """Whether config value ``value`` (plain data: ``OmegaConf.to_container``'s) is of type ``hint``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any or hint is object:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(fits(value, arg) for arg in args)
    if origin is typing.Literal:
        return value in args
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    kind = origin or hint
    if isinstance(kind, type) and issubclass(kind, os.PathLike):
        return isinstance(value, str)
    if isinstance(kind, type) and issubclass(kind, (list, tuple)) or kind is Sequence:
        return isinstance(value, (list, tuple))
    if isinstance(kind, type) and issubclass(kind, dict) or kind is Mapping:
        return isinstance(value, dict)
    return True  # a type config values are never of (an object the target builds itself): the target's to check


def describe(hint: Any) -> str:
    """``hint`` as the message says it (``bool``, ``int or None``, ...)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(describe(arg) for arg in args)
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(map(repr, args))
    if hint is type(None):
        return "None"
    return getattr(hint, "__name__", str(hint))
