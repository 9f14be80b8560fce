"""Are a torch.distributed resume state's values finite? Checked before a resume writes anything.

An FSDP2 run's Lightning state is a torch.distributed checkpoint folder (``*.distcp`` shards of
every rank, ``.metadata``, Lightning's ``meta.pt``). Its metadata says what each tensor is
(``run/resume_tensors.py`` compares names and shapes with the checkpoint's adapters); this reads
the values: every floating tensor of the state, the trainable tensors (``state_dict.*``) and both
optimizers' per-parameter state (``optimizer_<i>.state.*``: ``exp_avg``, ``exp_avg_sq``,
``step``), must be finite. A NaN or inf restored would stop the first update after the run's
config and logs are written, and a resume from the same checkpoint would stop again.

The values are read by torch.distributed.checkpoint itself (``dcp.load`` with ``no_dist``: one
process, no process group, whichever ranks wrote the shards) into tensors allocated from the
metadata, ``BATCH_BYTES`` of them at a time: the check holds one batch, not the state (a 27B
model's LoRA factors at r64 and their moments are ~3 GB, the shards of all ranks together).

Cost on CPU (a 2-core machine shared with other work, load ~2; a synthesized two-rank state of
1.26 GB fp32 in 896 tensors: r64 LoRA factors of eight 27B-wide layers, hidden 5120 and MLP 17408,
for both roles, and their moments): 1.1-1.4 s per GB
with the shards in the page cache, 1.5-1.7 s per GB with them read from disk, so ~4-5 s for the
27B's ~3 GB; the process's peak memory rose by 0.35 GB (one batch and its mask). Every rank of a
launch runs the start-up checks, so each reads the state once (the page cache serves the others).

``error`` (the caller's, ``ResumeStateError``) names the checkpoint, the tensor and how many of
its values are not finite (``resume_tensors.refuse_nonfinite``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

from atlas_lightning.errors import quoted

#: Tensor bytes read at a time: the batch, plus its finiteness mask (a quarter of fp32's bytes).
BATCH_BYTES = 256 * 2**20


def check_distributed_values(where: str, path: Path, metadata: dict, error: type[Exception]) -> None:
    """Refuse the torch.distributed state at ``path`` (a ``global_step_N/lightning`` folder whose
    names and shapes were checked; ``metadata``: its ``state_dict_metadata``, read by the caller)
    when one of its floating tensors holds NaN or inf."""
    for batch in _batches(metadata):
        _check_batch(where, path, batch, error)  # its tensors freed on return, before the next batch's


def _check_batch(where: str, path: Path, batch: list[tuple[str, tuple, object]], error: type[Exception]) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from atlas_lightning.run.resume_tensors import refuse_nonfinite

    tensors = {key: torch.empty(size, dtype=dtype) for key, size, dtype in batch}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(tensors, checkpoint_id=str(path), no_dist=True)
    except Exception as err:  # a damaged shard, whatever the library raises
        raise error(f"{where}: its Lightning state's tensor values cannot be read: {quoted(str(err))}") from None
    for key, tensor in tensors.items():
        refuse_nonfinite(where, key, tensor, error)


def _batches(metadata: dict) -> Iterator[list[tuple[str, tuple, object]]]:
    """The state's floating tensors as ``(key, size, dtype)``, in batches of at most
    ``BATCH_BYTES`` (a larger tensor alone), from the metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    batch: list[tuple[str, tuple, object]] = []
    held = 0
    for key, entry in sorted(metadata.items()):
        if not isinstance(entry, TensorStorageMetadata) or not entry.properties.dtype.is_floating_point:
            continue
        size = entry.size.numel() * entry.properties.dtype.itemsize
        if batch and held + size > BATCH_BYTES:
            yield batch
            batch, held = [], 0
        batch.append((key, tuple(entry.size), entry.properties.dtype))
        held += size
    if batch:
        yield batch
