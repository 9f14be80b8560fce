"""Merged weights to a vLLM server through vLLM's own weight-transfer API (the trainer side).

One ``ServerWeightTransfer`` per server, held by the training process that sends (rank 0).
The control plane is vLLM's: its ``HTTPVLLMWeightSyncClient`` on the server's RL routes
(``/init_weight_transfer_engine`` once, then per sync ``/start_weight_update``, one
``/update_weights`` per bucket, ``/finish_weight_update`` with the version), which exist when
the server runs with ``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config``. The data
plane is the backend's:

- ``nccl`` (GPUs): vLLM's ``NCCLWeightTransferEngine`` in the server; here vLLM's trainer
  endpoint (``nccl_common.trainer_init``) and its packed producer
  (``packed_nccl_broadcast_producer``), with the packed buffer sized to the bucket
  (``rollout.bucket_mb``) and ``packed_num_buffers`` of them on each side;
- ``gloo`` (CPU): ``gloo_transfer.GlooWeightTransferEngine``, registered in the server; each
  bucket is broadcast as the one contiguous buffer ``merged_weight_packs`` built, and the
  workers answer with the tensor count and sha256 of what they received (``digest.py``).

The bucket loop is the same for both: for each bucket, ``/update_weights`` (which blocks in
the server until the bucket has arrived) runs on a side thread while this thread broadcasts.
After ``finish`` the server's prefix cache is reset (its cached KV was computed with the old
weights; vLLM's finish does not drop it).

Two vLLM generations are served, told apart by what the installed vLLM has, not its version
string (``api_generation``): 0.32 (the CPU build) takes nccl's packing in the init info
(``nccl_common.worker_init_payload``), a weight version in ``finish_weight_update`` and has a
``shutdown_weight_transfer_engine`` route; 0.26 (the card's wheels) takes the packing in each
bucket's update info, no version, and has no shutdown route (the group is left with the process).

Memory for buckets (``planning``): the sender holds one packed bucket (``merged_weight_packs``)
plus, with ``nccl``, ``packed_num_buffers`` packed buffers of ``bucket_mb``; each server
worker holds ``packed_num_buffers`` receive buffers (``nccl``) or one (``gloo``).
"""

from __future__ import annotations

import logging
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Optional

import torch

from atlas_lightning.rollout.digest import WeightDigest
from atlas_lightning.rollout.engine import EngineError, SyncReport

log = logging.getLogger(__name__)

#: Buffers each side of the nccl transfer keeps in flight (vLLM's default, double buffering).
NCCL_NUM_BUFFERS = 2
BACKENDS = ("gloo", "nccl")


def default_backend() -> str:
    """``nccl`` where there are GPUs, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def bucket_info(views: list[tuple[str, torch.Tensor]], buffer: torch.Tensor) -> dict:
    """Names, dtypes, shapes and byte offsets of ``views`` inside ``buffer`` (what the
    server needs to cut the bucket back into tensors)."""
    base = buffer.data_ptr()
    return {
        "names": [name for name, _ in views],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in views],
        "shapes": [list(t.shape) for _, t in views],
        "offsets": [t.data_ptr() - base for _, t in views],
        "nbytes": int(buffer.numel() * buffer.element_size()),
    }


class ServerWeightTransfer:
    """Trainer end of the transfer to the server at ``url`` (``workers`` = its TP x PP ranks).

    ``connect()`` once (collective with the server: both sides join the transfer group);
    ``send(packs, version)`` per sync, returning what the server received (``gloo``: the
    workers' own count and sha256 per bucket; ``nccl``: what was sent, the server has no read-back:
    the weight-sync probe checks it). Raises ``EngineError`` naming the server on any failure.
    """

    def __init__(self, url: str, *, backend: str, bucket_bytes: int, workers: int = 1,
                 timeout_s: float = 600.0, host: str = "127.0.0.1") -> None:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        if backend not in BACKENDS:
            raise ValueError(f"weight transfer backend {backend!r} is not one of {BACKENDS}")
        self.url, self.backend, self.bucket_bytes = url, backend, int(bucket_bytes)
        self.world_size = 1 + workers
        self.host = host
        self.client = HTTPVLLMWeightSyncClient(url, timeout=timeout_s)
        self.group = None

    # -- set-up ---------------------------------------------------------------------------

    def _packing(self) -> dict:
        """nccl's packed broadcast settings; both ends must use the same."""
        return {"packed": True, "packed_buffer_size_bytes": self.bucket_bytes, "packed_num_buffers": NCCL_NUM_BUFFERS}

    def worker_init_info(self, port: int) -> dict:
        """What ``/init_weight_transfer_engine`` carries, as the installed vLLM's backend parses it."""
        rendezvous = {"master_address": self.host, "master_port": port, "rank_offset": 1,
                      "world_size": self.world_size}
        if self.backend == "gloo" or api_generation() < 32:  # 0.26: nccl's packing travels per bucket
            return rendezvous
        from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload

        return worker_init_payload(NCCLWeightTransferInitInfo(**rendezvous, **self._packing()))

    def _open_endpoint(self, port: int):
        if self.backend == "gloo":
            from atlas_lightning.rollout.engines.gloo_transfer import open_group

            return open_group(self.host, port, 0, self.world_size)
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        return trainer_init({"master_address": self.host, "master_port": port, "world_size": self.world_size})

    def connect(self) -> None:
        """Join the transfer group with the server's workers (they block in
        ``/init_weight_transfer_engine`` until this side arrives, so that call runs on a side thread)."""
        from atlas_lightning.rollout.engines.server_http import free_port

        port = free_port(self.host)
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(self.client.init_weight_transfer_engine, self.worker_init_info(port))
            try:
                self.group = self._open_endpoint(port)
            finally:
                self._result(pending, "init_weight_transfer_engine")
        log.info("weight transfer (%s) connected to %s", self.backend, self.url)

    # -- one sync -------------------------------------------------------------------------

    def send(self, packs: Iterable[tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]],
             version: Optional[int] = None) -> SyncReport:
        if self.group is None:
            self.connect()
        self._call(self.client.start_weight_update, "start_weight_update")
        count, entries, buckets, largest = 0, {}, 0, 0
        for buffer, views in packs:
            held_count, held_digest = self._send_bucket(buffer, views)
            count += held_count
            entries[f"bucket{buckets}"] = held_digest
            buckets += 1
            largest = max(largest, int(buffer.numel()))
        self._call(lambda: self._finish(version), "finish_weight_update")
        self._reset_prefix_cache()
        extra = {"buckets": buckets, "largest_bucket_bytes": largest, "backend": self.backend}
        if self.backend == "nccl":  # nothing comes back to compare: the probe checks the server
            return SyncReport(tensor_count=count, digest=None, form={"kind": "unverified"},
                              held="nothing (nccl has no read-back)", extra=extra)
        return SyncReport(tensor_count=count, digest=WeightDigest(entries), form={"kind": "buckets"},
                          held="received by the server's workers", extra=extra)

    def _finish(self, version: Optional[int]) -> None:
        if version is not None and api_generation() >= 32:
            self.client.finish_weight_update(str(version))
        else:  # 0.26's route takes no version; the sync probe is what proves which weights serve
            self.client.finish_weight_update()

    def update_info(self, buffer: torch.Tensor, views: list[tuple[str, torch.Tensor]]) -> dict:
        """What ``/update_weights`` carries for one bucket, as the installed vLLM's backend parses it."""
        info = bucket_info(views, buffer)
        if self.backend == "nccl":
            for key in ("offsets", "nbytes"):
                info.pop(key)
            if api_generation() < 32:
                info.update(self._packing())
        return info

    def _send_bucket(self, buffer: torch.Tensor, views: list[tuple[str, torch.Tensor]]) -> tuple[int, Optional[str]]:
        info = self.update_info(buffer, views)
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(self.client.update_weights, info)
            try:
                held = self._broadcast(buffer, views)
            except BaseException:
                # the server is stuck in the matching collective: never join it (vLLM's nccl
                # trainer engine does the same); the group is unusable now
                pool.shutdown(wait=False)
                self.group = None
                raise
            self._result(pending, "update_weights")
        return held

    def _broadcast(self, buffer: torch.Tensor, views: list[tuple[str, torch.Tensor]]) -> tuple[int, Optional[str]]:
        """``(tensor count, bucket sha256)`` of what the server received (gloo); ``(count, None)``
        with nccl, which reports nothing back (hashing what was sent would only compare it
        with itself, at some seconds a sync for the 8B's 16 GB)."""
        if self.backend == "gloo":
            from atlas_lightning.rollout.engines.gloo_transfer import gather_reports, read_report, report_tensor

            self.group.broadcast(buffer.cpu(), 0).wait()
            reports = gather_reports(self.group, report_tensor(0))[1:]
            first = reports[0]
            for other in reports[1:]:
                if not torch.equal(other, first):
                    raise EngineError(f"weight transfer to {self.url}: the server's workers received different "
                                      f"buckets ({[r.tolist() for r in reports]})")
            return read_report(first)
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        packed_nccl_broadcast_producer(iterator=iter(views), group=self.group, src=0,
                                       post_iter_func=lambda item: item[1], buffer_size_bytes=self.bucket_bytes,
                                       num_buffers=NCCL_NUM_BUFFERS)
        torch.cuda.current_stream().synchronize()
        return len(views), None

    # -- plumbing -------------------------------------------------------------------------

    def _call(self, fn, what: str) -> None:
        try:
            fn()
        except Exception as err:
            raise EngineError(f"weight transfer to {self.url}: {what} failed: {type(err).__name__}: {err}") from err

    def _result(self, future, what: str) -> None:
        try:
            future.result()
        except Exception as err:
            raise EngineError(f"weight transfer to {self.url}: {what} failed: {type(err).__name__}: {err}") from err

    def _reset_prefix_cache(self) -> None:
        from atlas_lightning.rollout.engines.server_http import error_message, http_call

        status, body = http_call(self.url, "POST", "/reset_prefix_cache", timeout=120.0)
        if status != 200:
            raise EngineError(f"vllm server {self.url}: /reset_prefix_cache answered {status}: {error_message(body)}")

    def close(self) -> None:
        """Leave the transfer group (the server keeps serving)."""
        group, self.group = self.group, None
        if group is None:
            return
        try:
            if api_generation() >= 32:  # 0.26 has no shutdown route: its workers keep the group to the end
                self.client.shutdown_weight_transfer_engine()
        except Exception as err:  # the server may be gone already
            log.warning("weight transfer to %s: shutdown failed: %s", self.url, err)
        if self.backend == "gloo":
            from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

            stateless_destroy_torch_distributed_process_group(group)
        else:
            group.destroy()


def api_generation() -> int:
    """32 where the installed vLLM has 0.32's weight-transfer API (``finish_weight_update`` with a
    version, the shutdown route, packing in the init info), else 26 (vLLM 0.26's)."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    return 32 if hasattr(HTTPVLLMWeightSyncClient, "shutdown_weight_transfer_engine") else 26


def bucket_bytes_of(bucket_mb: float) -> int:
    """``rollout.bucket_mb`` in bytes (MiB, as the config documents it)."""
    return int(math.floor(float(bucket_mb) * 2**20))
