"""A CPU backend for vLLM's own weight-transfer API (0.32's and 0.26's): ``gloo``, registered with vLLM's
``WeightTransferEngineFactory`` (the worker side of ``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``).

Why it exists: every backend vLLM 0.32 ships needs CUDA, Ray or an outside service (``nccl``,
``sparse_nccl`` and ``nccl_m2n`` open a ``PyNcclCommunicator``; ``ipc`` rebuilds CUDA IPC
handles; ``sharded_rdt`` pulls through Ray/NIXL; ``modelexpress`` is another package), and the
base ``WeightTransferEngine.update_weights`` calls ``torch.accelerator.synchronize()``, which
raises on a machine without an accelerator. The factory's registry is vLLM's documented
extension point ("custom engines can be registered at runtime"); this module is such an
engine, so that the separate layout's merged-weight path runs, end to end through vLLM's
server routes, on CPU. On GPUs the trainer uses vLLM's own ``nccl`` backend instead
(``rollout.weight_transfer``); the bucket loop on the trainer side is shared
(``weight_transfer.py``).

How it gets into the server: ``VLLMServer`` passes ``--worker-extension-cls
atlas_lightning.rollout.engines.gloo_transfer.GlooTransferExtension`` (vLLM imports that class in the
worker before it loads the model, which runs this module's registration) and
``--weight-transfer-config {"backend": "gloo"}``.

Wire protocol (one trainer, rank 0, and the server's workers, ranks ``rank_offset + r``, in a
stateless gloo group made by vLLM's ``stateless_init_torch_distributed_process_group``):

- per bucket the trainer POSTs ``/update_weights`` with ``GlooUpdateInfo`` (names, dtypes,
  shapes, byte offsets into the bucket, its total bytes) and at the same time broadcasts the
  bucket, one contiguous uint8 buffer (``models.weights.merged_weight_packs``), from rank 0;
- each worker receives it into a buffer of the same size, views the tensors out of it, loads
  them through the model's ``load_weights`` (inside vLLM's layerwise reload, opened by
  ``start_weight_update`` and closed by ``finish_weight_update``, as vLLM's own backends do),
  and then all-gathers ``(tensor count, sha256 of the bucket)`` of what it received
  (``digest.bucket_digest``: names, dtypes, shapes and bytes), which the trainer compares with
  what it sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

BACKEND = "gloo"


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Rendezvous of the transfer group: rank 0 is the trainer, workers start at ``rank_offset``."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One bucket: its tensors' names, dtypes (``torch`` attribute names), shapes and byte
    offsets in the bucket buffer of ``nbytes`` bytes."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    offsets: list[int]
    nbytes: int

    def __post_init__(self) -> None:
        n = len(self.names)
        if not (len(self.dtype_names) == len(self.shapes) == len(self.offsets) == n):
            raise ValueError(f"gloo update info: {n} names but {len(self.dtype_names)} dtypes, "
                             f"{len(self.shapes)} shapes, {len(self.offsets)} offsets")


def open_group(master_address: str, master_port: int, rank: int, world_size: int):
    """The transfer group, outside ``torch.distributed``'s global state (the trainer's own
    process group and vLLM's are left alone)."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(master_address, master_port, rank, world_size,
                                                          backend="gloo")


def report_tensor(count: int, digest_hex: str = "0" * 64) -> torch.Tensor:
    """``(tensor count, sha256 of the bucket)`` as 40 bytes: 8 for the count, 32 for the digest."""
    return torch.tensor(list(int(count).to_bytes(8, "little")) + list(bytes.fromhex(digest_hex)), dtype=torch.uint8)


def read_report(report: torch.Tensor) -> tuple[int, str]:
    raw = bytes(report.tolist())
    return int.from_bytes(raw[:8], "little"), raw[8:].hex()


def gather_reports(group, mine: torch.Tensor) -> list[torch.Tensor]:
    """Every member's report (``report_tensor``, rank order); collective over the transfer group."""
    out = [torch.empty_like(mine) for _ in range(group.size())]
    group.allgather([out], [mine]).wait()
    return out


def unpack(buffer: torch.Tensor, info: GlooUpdateInfo) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors as views into ``buffer`` (uint8, ``info.nbytes``)."""
    out = []
    for name, dtype_name, shape, offset in zip(info.names, info.dtype_names, info.shapes, info.offsets):
        dtype = getattr(torch, dtype_name)
        numel = 1
        for dim in shape:
            numel *= int(dim)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        out.append((name, buffer[offset:offset + nbytes].view(dtype).view(shape)))
    return out


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Worker side (runs inside vLLM's worker process; vLLM constructs it from
    ``weight_transfer_config``)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        rank = self.parallel_config.data_parallel_index * self.parallel_config.world_size + self.parallel_config.rank
        self.group = open_group(init_info.master_address, init_info.master_port, init_info.rank_offset + rank,
                                init_info.world_size)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """As the base class, without its unconditional ``torch.accelerator.synchronize()``
        (which raises where there is no accelerator)."""
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        from atlas_lightning.rollout.digest import bucket_digest

        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialized: call init_weight_transfer_engine first")
        buffer = torch.empty(update_info.nbytes, dtype=torch.uint8)
        self.group.broadcast(buffer, 0).wait()
        tensors = unpack(buffer, update_info)
        digest = bucket_digest(tensors)  # of what arrived, before the loader takes it
        self.model.load_weights([(name, t.to(self.device)) for name, t in tensors])
        gather_reports(self.group, report_tensor(len(tensors), digest))

    @staticmethod
    def trainer_send_weights(iterator, trainer_args) -> None:
        """vLLM 0.26 declares this abstract (0.32 moved the trainer's side into its own class): the
        trainer's side here is ``weight_transfer.ServerWeightTransfer``, never this."""
        raise NotImplementedError("the gloo backend's trainer side is atlas_lightning.rollout.engines."
                                  "weight_transfer.ServerWeightTransfer")

    def shutdown(self) -> None:
        if self.group is not None:
            from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

            stateless_destroy_torch_distributed_process_group(self.group)
            self.group = None


class GlooTransferExtension:
    """The ``--worker-extension-cls`` vLLM imports in each worker before loading the model:
    importing it registers the ``gloo`` backend there. It adds no methods to the worker."""


try:
    WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
except ValueError:  # registered already (a second import under another name)
    pass
