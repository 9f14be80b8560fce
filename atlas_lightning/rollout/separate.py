"""The separate layout's engine side (README, "The separate layout"): ONE vLLM server on the serving cards, shared by
every training process.

- ``build_separate_engine`` (collective, from ``RolloutDataModule.setup``): rank 0 starts the
  server (TP ``layout.engine_tp`` on cards ``train_gpus .. gpus - 1``; on CPU a CPU server) or
  attaches to ``rollout.server_url``, and every rank gets a ``SharedServerEngine`` on its URL.
  Each rank sends its own share of the step's requests (``RolloutDataModule`` treats each
  training rank as its own client); the server batches them all. The server is started with
  the colocated engines' arguments (``engines/args.EngineArgs``: ``max_num_seqs`` is
  ``min(rollout.max_in_flight, 1024)``, what ``plan`` sizes it for), and each of the W training
  ranks keeps ``rollout.max_in_flight // W`` requests in flight (``args.client_in_flight``), so
  the server never holds more than ``rollout.max_in_flight``.
- Weight movement is collective and driven by rank 0, the only rank that changes the server:
  ``set_adapter`` (LoRA sync: rank 0 loads the adapter under a new name, every rank then names
  it in its requests) and ``load_merged`` (merged sync: packed buckets, ``load_weight_packs``,
  through vLLM's weight-transfer API, ``weight_transfer.ServerWeightTransfer``; every rank
  drives the bucket generator, whose FSDP2 gathers are collective, and rank 0 sends). The
  report rank 0 gets is every rank's.

The weight sync holds every rank's ``engine_lock`` and passes a barrier before calling these,
so no rank's producer has requests in flight while the server's weights change.

With ``layout.share_cards`` the server runs on the training cards (``serving_cards``), started
in the data module's setup, which Lightning runs before ``configure_model``: vLLM checks that
``rollout.gpu_memory_utilization`` of the card is free and profiles its own use before the
trainer allocates anything (its CUDA context only), and the trainer lives in the rest.

Refused, with the reason: several servers (``layout.serve_gpus / layout.engine_tp > 1``), an
in-process engine (``rollout.engine`` other than ``vllm-server``) and sleep mode.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterable, Optional

import torch
from omegaconf import DictConfig

from atlas_lightning import distributed as dist_utils
from atlas_lightning.rollout.engine import AdapterVersion, MergedWeights, SyncReport
from atlas_lightning.rollout.engines.args import EngineArgs, client_in_flight
from atlas_lightning.rollout.engines.server_engine import ServerEngine
from atlas_lightning.rollout.engines.server_process import VLLMServer
from atlas_lightning.store.lora_shapes import LoraShape

log = logging.getLogger(__name__)


class SharedServerEngine(ServerEngine):
    """A training rank's client of the one shared server; rank 0 owns the server (``server``)
    and the weight transfer (``transfer``). Weight methods are collective over training ranks."""

    def __init__(self, url: str, *, rank: int, transfer=None, reads_back: bool = True, **kwargs) -> None:
        super().__init__(url, **kwargs)
        self.rank = rank
        self.transfer = transfer
        #: Merged weights: the server's workers report a digest of each bucket they received
        #: (gloo). False with nccl (no read-back): nothing is digested, the probe checks the server.
        self.reads_back = reads_back

    def set_adapter(self, adapter: Optional[AdapterVersion]) -> SyncReport:
        report, name = None, None
        if self.rank == 0:
            report = super().set_adapter(adapter)
            name = self._adapter
        report, name = dist_utils.broadcast_object((report, name))
        self._adapter = name
        self._model = name if name is not None else self._base
        return report

    def load_merged(self, weights: MergedWeights, version: int) -> SyncReport:
        """Merged weights reach the server as packed buckets (``load_weight_packs``), digested
        per bucket where the workers report what they received (``reads_back``)."""
        return self.load_weight_packs(weights.packs(digest=self.reads_back), version=version)

    def load_weight_packs(self, packs: Iterable, version: Optional[int] = None) -> SyncReport:
        """Merged weights in packed buckets to the server (rank 0 sends; the others only drive
        the generator, whose gathers are collective)."""
        report = None
        if self.rank == 0:
            if self.transfer is None:
                raise RuntimeError("merged-weight sync: rank 0 has no weight transfer (rollout.weight_sync=merged "
                                   "needs the server started with vLLM's weight-transfer API)")
            report = self.transfer.send(packs, version=version)
        else:
            for _ in packs:
                pass
        return dist_utils.broadcast_object(report)

    def close(self) -> None:
        if self.transfer is not None:
            self.transfer.close()
            self.transfer = None
        super().close()


def serving_cards(cfg: DictConfig) -> Optional[str]:
    """``CUDA_VISIBLE_DEVICES`` for the server: the cards after the training ones, or the training
    cards themselves with ``layout.share_cards`` (None on CPU)."""
    if not torch.cuda.is_available():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    cards = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    shared = bool(cfg.layout.get("share_cards", False))
    wanted = range(0, cfg.layout.train_gpus) if shared else range(cfg.layout.train_gpus, cfg.layout.gpus)
    if len(cards) < cfg.layout.gpus:
        raise RuntimeError(f"layout.gpus={cfg.layout.gpus} but this node shows {len(cards)} cards "
                           f"(CUDA_VISIBLE_DEVICES={visible!r})")
    return ",".join(cards[i] for i in wanted)


def build_separate_engine(cfg: DictConfig, rank: int, world_size: int,
                          actor_lora: Optional[LoraShape] = None) -> SharedServerEngine:
    """This rank's client of the separate layout's server (collective; see the module doc);
    ``actor_lora``: the actor's LoRA shape the run resolved (``EngineArgs.from_config``)."""
    from atlas_lightning.rollout.engines.weight_transfer import ServerWeightTransfer, bucket_bytes_of, default_backend

    from atlas_lightning.rollout.layout_checks import separate_refusals

    problems = separate_refusals(cfg)
    if problems:
        raise NotImplementedError("; ".join(problems))
    r = cfg.rollout
    merged = r.weight_sync == "merged"
    backend = (r.get("weight_transfer") or default_backend()) if merged else None
    server, url, error = None, None, None
    if rank == 0:
        try:
            if r.get("server_url"):
                url = r.server_url
            else:
                cards = serving_cards(cfg)
                server = VLLMServer(
                    EngineArgs.from_config(cfg, actor_lora), log_path=Path(cfg.paths.logs) / f"vllm-server-{cfg.name}-separate.log",
                    start_timeout_s=r.server_start_timeout_s,
                    env={"CUDA_VISIBLE_DEVICES": cards} if cards is not None else None, weight_transfer=backend)
                url = server.url
        except Exception as err:  # every rank must hear of it, not wait for a URL forever
            error = f"{type(err).__name__}: {err}"
    url, error = dist_utils.broadcast_object((url, error))
    if error is not None:
        raise RuntimeError(f"separate layout: rank 0 could not start the server: {error}")
    transfer = None
    try:
        if rank == 0 and merged:
            transfer = ServerWeightTransfer(url, backend=backend, bucket_bytes=bucket_bytes_of(r.bucket_mb),
                                            workers=cfg.layout.engine_tp, timeout_s=r.request_timeout_s + 60)
        return SharedServerEngine(url, rank=rank, transfer=transfer, server=server,
                                  max_in_flight=client_in_flight(cfg, world_size),
                                  request_timeout_s=r.request_timeout_s + 60, reads_back=backend != "nccl",
                                  streaming=bool(cfg.layout.get("partial_rollouts", False)))
    except BaseException:
        if server is not None:
            server.close()
        raise
