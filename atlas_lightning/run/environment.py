"""What the run needs of this machine, checked before anything is written: the cards
``trainer.accelerator`` asks for, W&B's key when it logs online (there, and of a form W&B takes)
and the settings W&B reads from the environment, the running server ``rollout.server_url`` names,
and the Hub (online, a token it accepts for writing) where the run uploads to it.

Who calls it: ``run/facts.check_inputs`` (fit, validate, memory-check), ``run/verbs.publish`` and the pre-flight's
``environment`` check (which may skip the card count on a CPU machine: ``--cpu-preflight``).
"""

from __future__ import annotations

import os
import sys

from atlas_lightning.config import ConfigError


def check_machine(cfg, *, count_gpus: bool = True) -> list[str]:
    """Notes on what was found; ``ConfigError`` naming the key when this machine cannot run
    ``cfg``: ``trainer.accelerator=gpu`` (or ``cuda``) where CUDA has fewer cards than
    ``trainer.devices`` (none at all on a CPU machine), a colocated server engine asked to sleep
    where there are cards (``rollout/factory.server_engine`` refuses it), ``logger.mode`` resolving to
    ``online`` with no W&B key (``WANDB_API_KEY``, or ``wandb login``'s) or one W&B refuses by its
    form, W&B's settings (its ``WANDB_*`` environment, ``logger.project``) that W&B would refuse at
    its start, or checkpoint uploads (``hub.publish_checkpoints``) the Hub would refuse
    (``check_hub_answers``)."""
    from atlas_lightning.loggers.wandb_logger import (
        check_wandb_settings,
        refused_wandb_key,
        resolve_wandb_mode,
        wandb_credentials,
    )

    notes = []
    t = cfg.trainer
    if t.accelerator in ("gpu", "cuda") and count_gpus:
        found = _gpu_count()
        if found < t.devices:
            where = "this machine has no CUDA GPU" if found == 0 else f"{found} visible here"
            raise ConfigError(f"trainer.accelerator={t.accelerator} with trainer.devices={t.devices}: {where} "
                              f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); on a CPU "
                              f"machine use a CPU experiment (experiment=tiny-cpu) or trainer.accelerator=cpu")
        notes.append(f"{found} GPUs visible")
    r = cfg.rollout
    if cfg.layout.mode == "colocated" and r.engine == "vllm-server" and r.enable_sleep_mode and _gpu_count() > 0:
        raise ConfigError("rollout.enable_sleep_mode=true with rollout.engine=vllm-server on GPUs: the server cannot "
                          "sleep (its /sleep route is dev-mode only); set rollout.enable_sleep_mode=false or use "
                          "rollout.engine=vllm")
    if r.server_url:
        _check_server_answers(r.server_url)
    if cfg.hub.publish_checkpoints:
        check_hub_online("hub.publish_checkpoints=true")
        check_hub_token("hub.publish_checkpoints=true", "or hub.publish_checkpoints=false (publish later with "
                                                        "atlas-lightning publish)")
        notes += check_hub_answers(cfg)
    if resolve_wandb_mode(cfg.logger.mode) != "disabled":
        check_wandb_settings(cfg)
    if resolve_wandb_mode(cfg.logger.mode) == "online":
        source = wandb_credentials()
        if source is None:
            raise ConfigError("logger.mode=online but W&B has no API key here: set WANDB_API_KEY or run `wandb login`, "
                              "or log offline (logger.mode=offline; `wandb sync` uploads it later)")
        refused = refused_wandb_key()
        if refused:
            raise ConfigError(f"logger.mode={cfg.logger.mode} logs online, but W&B refuses the key in {refused} Set "
                              f"WANDB_API_KEY to your key (or `wandb login --relogin`), or use logger.mode=offline "
                              f"(`wandb sync` later)")
        notes.append(f"W&B key from {source}")
    return notes


def check_hub_answers(cfg) -> list[str]:
    """The Hub ``hub.endpoint`` names accepts the token for the checkpoint uploads, asked once
    (``HubUploader.check_token``: whoami) before anything is written: a token it refuses or that
    can only read, or an endpoint that is no Hub, is a ``HubRefusedError`` (exit 2; the uploads
    would otherwise fail mid-run, in the background). A Hub that cannot be reached now is not
    refused: the run goes on, each checkpoint's upload is tried again after the next and at the
    end (the callback's policy; ``publish --weights`` later), so an outage does not cost a launch;
    it is a warning on the console (rank 0) and the note returned."""
    from lightning.pytorch.utilities import rank_zero_only

    from atlas_lightning.hub.client import HubPublishError, HubRefusedError, HubUploader

    uploader = HubUploader(cfg.hub.repo_id, repo_type=cfg.hub.repo_type, endpoint=cfg.hub.endpoint)
    try:
        account = uploader.check_token()
    except HubRefusedError as err:
        raise type(err)(f"hub.publish_checkpoints=true: {err}") from None  # a HubCredentialsError stays one
    except HubPublishError as err:
        note = (f"hub.publish_checkpoints=true: {err}; training goes on, each checkpoint's upload is tried "
                f"again (hub.publish_checkpoints=false turns them off)")
        rank_zero_only(print)(f"atlas-lightning: warning: {note}", file=sys.stderr)
        return [note]
    return [f"Hub token accepted by {uploader.where}" + (f" (account {account})" if account else "")]


def check_hub_online(what: str) -> None:
    """``ConfigError`` when ``HF_HUB_OFFLINE`` switches the Hub off, for ``what`` needs it (every
    upload would fail, retried as if the network were down)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise ConfigError(f"{what} uploads to the Hub, but HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '1')} "
                          f"(environment) switches it off: unset HF_HUB_OFFLINE for this command")


def _check_server_answers(url: str) -> None:
    """The running vLLM server ``rollout.server_url`` names answers ``/health``, and ``/v1/models``
    with the base model it serves (the run would otherwise write its files and stop at its
    engine's first request)."""
    from atlas_lightning.config import redacted_text
    from atlas_lightning.rollout.engines.server_http import HTTP_ERRORS, http_call

    try:
        status, body = http_call(url, "GET", "/health", timeout=10.0)
    except HTTP_ERRORS as err:
        raise ConfigError(f"rollout.server_url={redacted_text(url)}: no server answers there ({type(err).__name__}); "
                          f"start the vLLM server first, or leave rollout.server_url null for the run to start its own") \
            from None
    if status != 200:
        raise ConfigError(f"rollout.server_url={redacted_text(url)}: /health answered {status}, not 200: the server "
                          f"is not ready to serve")
    # what the engine asks first, asked here: an answer that is no vLLM server's stops the run now,
    # before its files are written, not at the engine's construction
    from atlas_lightning.rollout.engine import EngineError
    from atlas_lightning.rollout.engines.server_engine import base_card, model_cards

    key = f"rollout.server_url={redacted_text(url)}"
    try:
        status, body = http_call(url, "GET", "/v1/models", timeout=10.0)
        base_card(key, model_cards(key, status, body))
    except HTTP_ERRORS as err:
        raise ConfigError(f"{key}: /v1/models did not answer ({type(err).__name__})") from None
    except EngineError as err:
        raise ConfigError(f"{redacted_text(str(err))}: is it a vLLM server?") from None


def check_hub_token(what: str, otherwise: str) -> None:
    """A Hub token is there (``HF_TOKEN`` or ``hf auth login``'s) for ``what`` (the checkpoint
    uploads: without one each would fail mid-run, in the background, saying so only in the log;
    ``publish``: it could only be refused after the Hub was asked). ``ConfigError`` naming
    ``what`` and how to give one, then ``otherwise``, when there is none."""
    from huggingface_hub import get_token

    try:
        token = get_token()
    except Exception:  # an unreadable saved login is no token
        token = None
    if not token:
        raise ConfigError(f"{what} but there is no Hub token here: set HF_TOKEN to a token with write access or run "
                          f"`hf auth login`; {otherwise}")


def trains_on_gpu(accelerator: str) -> bool:
    """Whether ``trainer.accelerator`` puts training on GPUs (``auto``: when CUDA is present)."""
    import torch

    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def _gpu_count() -> int:
    """CUDA devices torch sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
