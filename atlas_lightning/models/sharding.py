"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for an ``ActorCritic``.

Units, innermost first:

* each decoder layer (its frozen base weights and both adapters' LoRA factors together);
* the value head, alone, with an fp32 policy (values stay fp32 whatever the compute dtype);
* the root ``ActorCritic``: embeddings, final norm, lm_head (used by the chunked log-probs
  inside the root's forward; the root is not resharded between forward and backward).

Every parameter is sharded on dim 0 over the mesh, frozen base parameters too, unevenly when
a dim does not divide by the world size (torch.chunk semantics; ``weights.py`` gathers whole
tensors before any merge for that reason).

Mixed precision: on GPUs ``param_dtype=bfloat16`` (the fp32 LoRA masters are cast for
compute; a bf16 base stays bf16) and ``reduce_dtype=float32`` (gradients reduce-scattered in
fp32); on CPU no casting (fp32), as gloo tests need. ``actor_forward`` & co. go through the
module call, so FSDP2's hooks run on every pass.

Who calls it: the PPO module's ``configure_model`` where the data-parallel mesh (Lightning's
``ModelParallelStrategy`` gives it) has several ranks (one rank keeps the model unsharded), the
multi-process tests.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from .actor_critic import ActorCritic

_DEFAULT = object()


def default_param_dtype(mesh: DeviceMesh) -> Optional[torch.dtype]:
    """bf16 compute on accelerators, none (keep fp32) on CPU."""
    return None if mesh.device_type == "cpu" else torch.bfloat16


def shard(
    model: ActorCritic,
    mesh: DeviceMesh,
    *,
    param_dtype: Optional[torch.dtype] | object = _DEFAULT,
    reduce_dtype: Optional[torch.dtype] = torch.float32,
    reshard_after_forward: bool = True,
) -> ActorCritic:
    """Apply ``fully_shard`` to each decoder layer, the value head and the root, in place;
    returns ``model``. ``mesh`` is a 1-D data-parallel mesh (``init_device_mesh(type, (n,))``).
    ``param_dtype`` defaults to ``default_param_dtype(mesh)``. Call once, on every rank, after
    loading adapters or before (``adapters.load_adapter`` handles sharded parameters)."""
    if not isinstance(model, ActorCritic):
        raise TypeError(f"shard expects an ActorCritic, got {type(model).__name__}")
    if mesh.ndim != 1:
        raise ValueError(f"shard expects a 1-D data-parallel mesh, got {mesh.ndim} dims {mesh.mesh_dim_names}")
    if param_dtype is _DEFAULT:
        param_dtype = default_param_dtype(mesh)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    fp32_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for layer in model.decoder_layers():
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model.value_head, mesh=mesh, mp_policy=fp32_policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    return model
