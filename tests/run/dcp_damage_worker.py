"""Rewrite one value of a torch.distributed checkpoint in place, through torch.distributed.checkpoint,
in the layout the run saved it (``test_resume_distributed_values.py``):

    python tests/forked_ranks.py W dcp_damage_worker.py STATE KEY INDEX VALUE

``STATE``: a ``global_step_N/lightning`` folder that ``W`` ranks wrote; ``KEY``: one of its
tensors (``state_dict.<name>`` or ``optimizer_<i>.state.<param>.<kept>``); ``INDEX``: the
element of the flattened tensor set to ``VALUE`` (``nan``, ``inf``, ...). Every rank loads the
whole state (plain tensors), sets the value, makes the tensors FSDP2 had sharded (a chunk per
rank in the metadata) DTensors sharded on dim 0 again and saves: each rank writes its own shards
of the same keys to the same files (``__<rank>_0.distcp``), rank 0 the metadata. ``meta.pt`` is
left as it was.
"""

from __future__ import annotations

import sys
import warnings

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import get_element, set_element
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor


def main() -> None:
    path, key, index, value = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    metadata = dcp.FileSystemReader(path).read_metadata()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = _load_state_dict_from_keys(checkpoint_id=path)
    get_element(state, metadata.planner_data[key]).view(-1)[index] = value
    for name, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata) and len(entry.chunks) > 1:
            whole = get_element(state, metadata.planner_data[name])
            set_element(state, metadata.planner_data[name], distribute_tensor(whole, mesh, [Shard(0)]))
    dcp.save(state, checkpoint_id=path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
