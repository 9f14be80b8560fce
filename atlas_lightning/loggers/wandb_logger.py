"""The run's loggers: W&B (through Lightning's ``WandbLogger``) and our own run export.

``build_loggers(cfg)`` returns, in this order:

1. ``RLStepWandbLogger`` unless ``logger.mode`` resolves to ``disabled``: project, entity and tags
   from ``cfg.logger``, run name ``cfg.name``, the resolved config as the W&B run config, files under
   ``<root>/wandb/`` (W&B itself adds the ``wandb/`` level to the ``dir`` it is given, so it gets
   ``<root>``).
2. ``RunExportLogger`` (``atlas_lightning.loggers.run_export``) writing
   ``runs/<name>/<run id>/{history.csv, config.json, summary.json}``.

Both share one run id: the W&B id (8 characters of ``[a-z0-9]``, W&B's own format) or, with W&B
disabled, ``offline-<UTC time>-<random>``. The id is ``run_id`` when given, else ``WANDB_RUN_ID``
from the environment (W&B's own convention for continuing a run), else a new one.

Modes (``logger.mode``): ``online``, ``offline``, ``disabled``, or ``auto``: ``WANDB_MODE`` from
the environment when it names one of those (``dryrun`` counts as ``offline``), else ``online`` when
W&B has a key (``WANDB_API_KEY``, or the login ``wandb login`` saved: ``wandb_credentials``), else
``offline``. ``online`` without a key, or with one W&B refuses by its form (``refused_wandb_key``),
is refused before the run writes anything (``run/environment.check_machine``).

W&B's start (``wandb.init``, at the trainer's set-up, after the run's config and logs are written:
``run/wiring.prepare_run``) may still fail online: the server refuses the key, or cannot be
reached within W&B's ``init_timeout`` (90 s; ``WANDB_INIT_TIMEOUT``). Either is a ``ConfigError``
naming ``logger.mode`` and what to do (exit 2, one line), except that ``auto`` takes a W&B it
cannot reach as a reason to log offline: a warning on the console and in the run's log, the same
run id, ``wandb sync`` later. A key the server refuses stays an error in every mode.

Steps: the module calls every logger's ``log_metrics(metrics, step=rl_step)``. W&B's own ``_step``
*is* the RL step (``run.log(metrics, step=rl_step)``, as verl does), so the W&B charts, the W&B
export and ``history.csv`` share one x axis; Lightning's optimizer-step count never reaches a
logger. W&B drops a row logged at a step below one it already has (a resumed run replaying steps
it had logged); the run export keeps it.

``log_image(trainer, key, path, step)`` logs a PNG to W&B when the trainer has a W&B logger (the
figures callback calls it; a no-op otherwise).
"""

from __future__ import annotations

import logging
import os
import secrets
import string
import sys
import time
from pathlib import Path
from unittest import mock
from typing import Any, Mapping, Optional, Union

from lightning.fabric.utilities.logger import _add_prefix
from lightning.pytorch.loggers import Logger, WandbLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from omegaconf import DictConfig

from atlas_lightning.loggers.run_export import RunExportLogger
from atlas_lightning.config import ConfigError, is_credential_key, redacted, redacted_argv, redacted_text

log = logging.getLogger(__name__)

WANDB_MODES = ("online", "offline", "disabled")
_ID_ALPHABET = string.ascii_lowercase + string.digits


def resolve_wandb_mode(mode: str, environ: Optional[Mapping[str, str]] = None) -> str:
    """``logger.mode`` -> ``online``, ``offline`` or ``disabled`` (rules in the module docstring)."""
    environ = os.environ if environ is None else environ
    if mode in WANDB_MODES:
        return mode
    if mode != "auto":
        raise ConfigError(f"logger.mode={mode!r} is not one of auto, {', '.join(WANDB_MODES)}")
    from_env = environ.get("WANDB_MODE", "").strip().lower()
    if from_env == "dryrun":
        return "offline"
    if from_env in WANDB_MODES:
        return from_env
    return "online" if wandb_credentials(environ) else "offline"


def wandb_credentials(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Where W&B would find an API key, or None: ``WANDB_API_KEY``, else the netrc entry
    ``wandb login`` writes for the W&B host (``WANDB_BASE_URL``'s, default api.wandb.ai; the file
    ``NETRC`` names, default ``~/.netrc``). The key itself is never returned."""
    return _credentials(environ)[0]


def refused_wandb_key(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Where the key W&B would log in with is and why W&B refuses its form (``WANDB_API_KEY: API
    key must have 40+ characters, has 5.``), never the key; None when W&B takes it or there is
    none. W&B's own rule (``wandb.sdk.lib.wbauth.check_api_key``, which ``wandb.init`` applies
    only once the run has written its files)."""
    from wandb.sdk.lib.wbauth import check_api_key

    source, key = _credentials(environ)
    problem = check_api_key(key) if key else None
    return f"{source}: {problem}" if problem else None


def _credentials(environ: Optional[Mapping[str, str]]) -> tuple[Optional[str], Optional[str]]:
    """``(where, key)`` of ``wandb_credentials``; ``(None, None)`` without a key."""
    import netrc
    from urllib.parse import urlparse

    environ = os.environ if environ is None else environ
    if environ.get("WANDB_API_KEY"):
        return "WANDB_API_KEY", environ["WANDB_API_KEY"]
    host = urlparse(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    path = Path(environ.get("NETRC") or Path(environ.get("HOME") or Path.home()) / ".netrc").expanduser()
    try:
        entry = netrc.netrc(str(path)).authenticators(host) if path.is_file() else None
    except (OSError, netrc.NetrcParseError):
        entry = None
    return (f"{path} (wandb login)", entry[2]) if entry and entry[2] else (None, None)


def check_wandb_settings(cfg: DictConfig, environ: Optional[Mapping[str, str]] = None) -> None:
    """What W&B reads at its start, checked by W&B's own settings model before anything is
    written (W&B itself would raise only inside ``wandb.init``, mid-launch): every ``WANDB_*``
    variable of ``environ`` (``WANDB_MODE=garbage``, ``WANDB_BASE_URL``, ``WANDB_RUN_ID``, ...) and
    ``logger.project`` / ``logger.tags``. ``ConfigError`` naming the variable or key; a
    credential's value is never repeated."""
    from wandb.sdk.wandb_settings import Settings

    environ = os.environ if environ is None else environ
    for name in sorted(k for k in environ if k.startswith("WANDB_")):
        try:
            Settings().update_from_env_vars({name: environ[name]})
        except Exception as err:  # pydantic's ValidationError, or W&B's UsageError
            shown = "***" if is_credential_key(name.lower()) else repr(environ[name])
            raise ConfigError(f"{name}={shown} (environment): W&B refuses it: {_first_reason(err)}; unset it or fix "
                              f"its value (logger.mode=disabled runs without W&B)") from None
    for key, setting, value in (("logger.project", "project", cfg.logger.project),
                                ("logger.tags", "run_tags", tuple(cfg.logger.tags or ()))):
        try:
            Settings(**{setting: value})
        except Exception as err:
            raise ConfigError(f"{key}={value!r}: W&B refuses it: {_first_reason(err)}") from None


def _first_reason(err: Exception) -> str:
    """pydantic's first error message without the value it quotes (which may be a secret), else the text."""
    errors = getattr(err, "errors", None)
    if callable(errors):
        try:
            return str(errors()[0]["msg"])
        except Exception:
            pass
    return " ".join(str(err).split())


def new_run_id(wandb_enabled: bool) -> str:
    """A W&B-style id (8 of ``[a-z0-9]``) or, without W&B, ``offline-YYYYmmddTHHMMSSZ-<6 random>``."""
    if wandb_enabled:
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(8))
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return f"offline-{stamp}-{''.join(secrets.choice(_ID_ALPHABET) for _ in range(6))}"


class RLStepWandbLogger(WandbLogger):
    """Lightning's ``WandbLogger`` with W&B's ``_step`` equal to the step given to ``log_metrics``
    (the RL step). Lightning's version logs ``trainer/global_step`` and points every chart at it;
    here nothing else defines the x axis. ``setting``: ``logger.mode`` as configured, which W&B's
    failures name (and ``auto`` falls back to offline on a W&B it cannot reach: module doc)."""

    def __init__(self, *args: Any, setting: Optional[str] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)  # W&B warns about the setting even when unset
        self._setting = setting or self._wandb_init.get("mode") or "online"

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._experiment is None:
            import wandb

            if wandb.run is not None:
                # Same policy as Lightning: one W&B run a process; a second logger reuses it.
                rank_zero_warn(f"A W&B run ({wandb.run.id}) is already active in this process and is reused; "
                               f"the run export keeps the id {self._id}.")
                self._experiment = wandb.run
            else:
                # W&B records the command line (its metadata's ``args``) from sys.argv at init:
                # it sees the redacted one, so no credential given as an override reaches its files
                with mock.patch.object(sys, "argv", redacted_argv(sys.argv)):
                    self._experiment = self._start()
        return self._experiment

    def _start(self) -> Any:
        """``wandb.init``; what it raises as a ``ConfigError`` naming ``logger.mode``, or, for
        ``auto`` and a W&B it cannot reach, the same run started offline (module doc)."""
        import wandb

        try:
            return wandb.init(**self._wandb_init)
        except wandb.errors.Error as err:
            mode = self._wandb_init.get("mode")
            unreachable = mode == "online" and _unreachable(err)
            if not (self._setting == "auto" and unreachable):
                raise ConfigError(_start_refusal(self._setting, mode, err, unreachable)) from None
            said = _said(err)
        line = (f"logger.mode=auto: W&B at {_host()} could not be reached ({said}): logging offline; `wandb sync "
                f"{Path(self.save_dir or '.') / 'wandb'}/offline-run-*` uploads the run later")
        log.warning("%s", line)
        print(f"atlas-lightning: warning: {redacted_text(line)}", file=sys.stderr)
        wandb.teardown()  # W&B's service keeps the failed run's id: a new one starts the same id offline
        self._wandb_init["mode"] = "offline"
        return wandb.init(**self._wandb_init)

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int] = None) -> None:
        metrics = _add_prefix(dict(metrics), self._prefix, self.LOGGER_JOIN_CHAR)
        if step is None:
            self.experiment.log(metrics)
        else:
            self.experiment.log(metrics, step=int(step))


def _unreachable(err: Exception) -> bool:
    """Whether ``wandb.init``'s ``err`` comes from a W&B server that could not be reached: a
    communication error, not a refused key, and the server does not answer a plain request now
    (W&B's own text differs by what it was asking: a run's resume status, the run itself)."""
    import requests
    from wandb.errors import AuthenticationError, CommError

    if not isinstance(err, CommError) or isinstance(err, AuthenticationError):
        return False
    try:
        requests.head(_host(masked=False), timeout=10)
    except requests.RequestException:
        return True
    return False


def _start_refusal(setting: str, mode: Optional[str], err: Exception, unreachable: bool) -> str:
    """The one line for a ``wandb.init`` that failed in ``mode`` (``unreachable``: ``_unreachable``),
    ``logger.mode`` being ``setting``."""
    from wandb.errors import AuthenticationError

    said, key = _said(err), f"logger.mode={setting}"
    if mode != "online":
        return f"{key}: W&B could not start {mode}: {said}; logger.mode=disabled runs without W&B"
    if unreachable:
        return (f"{key}: W&B at {_host()} could not be reached: {said}; check the network and WANDB_BASE_URL, or use "
                f"logger.mode=offline")
    refused = "the key" if isinstance(err, AuthenticationError) else "the run"
    return (f"{key}: W&B at {_host()} refused {refused}: {said}; check WANDB_API_KEY, logger.entity, logger.project, "
            f"or use logger.mode=offline")


def _said(err: Exception, limit: int = 100) -> str:
    """W&B's error in a few words: its message's first line, cut at ``limit`` (W&B adds lines of
    advice about ``wandb.init``'s own arguments, not this command's), else its type."""
    lines = str(err).strip().splitlines()
    text = " ".join(lines[0].split()) if lines and lines[0] != "<no message>" else ""
    if not text:
        return type(err).__name__
    return text if len(text) <= limit else f"{text[:limit]}..."


def _host(masked: bool = True) -> str:
    """The W&B server ``wandb.init`` used (``WANDB_BASE_URL`` or W&B's default), its password masked."""
    from wandb.sdk import wandb_setup

    url = str(wandb_setup.singleton().settings.base_url)
    return redacted_text(url) if masked else url


def build_loggers(cfg: DictConfig, run_id: Optional[str] = None) -> list[Logger]:
    """The run's loggers (see the module docstring). Creates nothing on disk and starts no W&B
    process: W&B starts on the first ``experiment`` access (rank 0), the export on the first write."""
    mode = resolve_wandb_mode(cfg.logger.mode)
    wandb_enabled = mode != "disabled"
    run_id = run_id or os.environ.get("WANDB_RUN_ID") or new_run_id(wandb_enabled)
    config = redacted(cfg)  # no credential in W&B's files or the export
    loggers: list[Logger] = []
    if wandb_enabled:
        loggers.append(
            RLStepWandbLogger(
                name=cfg.name,
                save_dir=str(Path(cfg.paths.wandb).parent),  # W&B makes its "wandb" folder there
                id=run_id,
                project=cfg.logger.project,
                entity=cfg.logger.entity,
                tags=list(cfg.logger.tags or []),
                config=config,
                mode=mode,
                setting=cfg.logger.mode,
            )
        )
    loggers.append(RunExportLogger(Path(cfg.paths.runs), run_id, config))
    return loggers


def log_image(trainer: Any, key: str, path: Union[str, os.PathLike], step: int) -> bool:
    """Log the PNG at ``path`` under ``key`` at RL step ``step`` to the trainer's W&B logger.

    Returns True when logged, False when there is no W&B logger or this is not rank 0.
    Raises ``FileNotFoundError`` naming the path when there is a logger but no file."""
    if not getattr(trainer, "is_global_zero", True):
        return False
    wandb_loggers = [lg for lg in getattr(trainer, "loggers", []) if isinstance(lg, WandbLogger)]
    if not wandb_loggers:
        return False
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"log_image({key!r}): no image file at {path}")
    import wandb

    for logger in wandb_loggers:
        if isinstance(logger, RLStepWandbLogger):
            logger.experiment.log({key: wandb.Image(str(path))}, step=int(step))
        else:
            logger.log_image(key=key, images=[str(path)], step=int(step))
    return True
