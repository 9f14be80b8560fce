"""One rank of the FSDP2 equivalence check (gloo, CPU), run at W ranks by ``tests/forked_ranks.py``
(torchrun's variables; ``torch.distributed.run`` runs it the same way):

    python tests/forked_ranks.py W fsdp_worker.py BASE OUT

Every rank builds the same ActorCritic (same seed, adapters set to deterministic non-zero
values), shards it over W ranks, switches it to a mixed recompute plan (``enable_recompute_tiers``:
mixer, none, layer in turn) and runs, on ITS OWN packed batch, actor, critic and base
passes and one backward of ``sum_r loss_r / W`` (FSDP2 averages gradients over ranks).
Rank 0 also builds the same model unsharded, in this same process, and computes the
reference: every rank's batch, and the gradients of ``sum_r loss_r / W``. It then compares:

* per-rank log-probs, entropies, values, base log-probs (gathered from the ranks);
* full (gathered) LoRA and value-head gradients;
* ``merged_weights`` of both adapters against the same export of the unsharded model, bit
  for bit (same process, one thread, so the same arithmetic), and against peft's own
  ``merge_and_unload()`` of an unsharded copy (an independent merge: equal up to rounding,
  ``max_err``);
* ``adapter_state`` against the unsharded adapter;
* ``save_adapter`` under FSDP2 (rank 0 writes) then ``load_adapter`` into zeroed sharded
  parameters gives back the same full parameters.

Rank 0 writes ``OUT/report.json``; the test asserts on it. Not collected by pytest.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

torch.set_num_threads(1)

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from atlas_lightning.config import ModelConfig  # noqa: E402
from atlas_lightning.models.actor_critic import ActorCritic  # noqa: E402
from atlas_lightning.models.adapters import load_adapter, save_adapter  # noqa: E402
from atlas_lightning.models.build import load_base  # noqa: E402
from atlas_lightning.models.packing import pack_sequences  # noqa: E402
from atlas_lightning.models.sharding import shard  # noqa: E402
from atlas_lightning.models.weights import adapter_state, full_tensor, merged_weights  # noqa: E402

LORA = {"rank": 5, "alpha": 10, "dropout": 0.0, "target_modules": "all-linear"}
CHUNK = 7


def build(base: str) -> ActorCritic:
    config = ModelConfig(path=base, dtype="float32", gradient_checkpointing=True, logprob_chunk_tokens=CHUNK)
    model = ActorCritic(config, load_base(config), {"actor": LORA, "critic": LORA}, seed=0)
    # LoRA B starts at zero: give every adapter parameter deterministic non-zero values
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for param in model.actor_parameters() + model.critic_parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def batch_for(rank: int, vocab: int):
    generator = torch.Generator().manual_seed(100 + rank)
    lengths = [9 + 3 * rank, 5, 14 - rank]
    prompts = [3, 2, 4]
    seqs = [torch.randint(0, vocab, (n,), generator=generator) for n in lengths]
    return pack_sequences(seqs, prompts)


def passes(model: ActorCritic, packed):
    log_probs, entropy = model.actor_forward(packed, temperature=0.8)
    values = model.critic_forward(packed)
    base = model.base_forward(packed, temperature=0.8)
    # a loss touching both adapters, weighted per token so that positions matter
    weights = torch.linspace(0.5, 1.5, log_probs.numel())
    loss = (log_probs * weights).sum() + (entropy * 0.1).sum() + ((values - 0.3) ** 2 * weights).sum()
    return loss, {"log_probs": log_probs, "entropy": entropy, "values": values, "base": base}


def named_grads(model: ActorCritic) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            grad = param.grad
            out[name] = None if grad is None else full_tensor(grad).clone()
    return out


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def against_unsharded(base: str, vocab: int, world: int, gathered: list, grads: dict, merged: dict, states: dict,
                      before: dict, after: dict) -> dict:
    """Rank 0: the sharded run's outputs, gradients, merged weights, adapter states and reload
    compared with one unsharded model on every rank's batch (the report's entries)."""
    report = {}
    reference = build(base)
    ref_loss = 0.0
    for r in range(world):
        loss_r, ref_out = passes(reference, batch_for(r, vocab))
        ref_loss = ref_loss + loss_r / world
        for key, value in ref_out.items():
            report[f"err/{key}/rank{r}"] = max_err(gathered[r][key], value.detach())
    ref_loss.backward()
    ref_grads = named_grads(reference)
    report["grad_names_equal"] = sorted(grads) == sorted(ref_grads)
    report["grads_none"] = sorted(n for n, g in grads.items() if g is None)
    report["grad_scale"] = max(float(g.abs().max()) for g in ref_grads.values() if g is not None)
    report["err/grads"] = max(max_err(grads[n], ref_grads[n]) for n in ref_grads if ref_grads[n] is not None)

    for adapter in ("actor", "critic"):
        peft_copy = copy.deepcopy(reference.peft_model)
        peft_copy.set_adapter(adapter)
        expected = peft_copy.merge_and_unload().state_dict()
        names = reference.checkpoint_names
        expected = {names[k]: v for k, v in expected.items() if k in names}
        got = merged[adapter]
        report[f"merged/{adapter}/names_equal"] = sorted(got) == sorted(expected)
        report[f"merged/{adapter}/dtypes_equal"] = all(got[k].dtype == expected[k].dtype for k in expected)
        report[f"merged/{adapter}/max_err"] = max(max_err(got[k], expected[k]) for k in expected)
        unsharded = dict(merged_weights(reference, adapter))
        report[f"merged/{adapter}/equals_unsharded_export"] = sorted(unsharded) == sorted(got) and all(
            torch.equal(got[k], unsharded[k]) for k in got
        )
        base_weights = load_file(str(Path(base) / "model.safetensors"))
        report[f"merged/{adapter}/changed_tensors"] = sum(
            not torch.equal(got[k], base_weights[k]) for k in got if k in base_weights
        )
        ref_state = adapter_state(reference, adapter)
        report[f"state/{adapter}/equal"] = sorted(ref_state) == sorted(states[adapter]) and all(
            torch.equal(ref_state[k], states[adapter][k]) for k in ref_state
        )
    report["reload/equal"] = sorted(before) == sorted(after) and all(
        torch.equal(before[k], after[k]) for k in before
    )
    report["checkpoint_name_example"] = sorted(merged["actor"])[:3]
    return report


def main(base: str, out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    started = time.perf_counter()

    model = build(base)
    vocab = model.hf_model.get_output_embeddings().weight.shape[0]
    shard(model, mesh)
    dtensors = [p for p in model.parameters() if isinstance(p, DTensor)]
    sharding = {
        "all_params_sharded": len(dtensors) == len(list(model.parameters())),
        "uneven_params": sum(p.shape[0] % world != 0 for p in dtensors),
    }
    empty = torch.tensor([sum(p.to_local().numel() == 0 for p in dtensors)])
    dist.all_reduce(empty)  # summed over ranks: the short ranks are the last ones
    sharding["empty_local_shards"] = int(empty)
    # the sharded model runs a mixed recompute plan switched in after sharding (model.checkpoint_layers=auto's
    # per-micro-batch tiers: mixer checkpoints, whole layers, kept layers), the reference every layer
    # replayed whole: recomputation changes no number
    mixed = [("mixer", "none", "layer")[i % 3] for i in range(len(model.decoder_layers()))]
    model.enable_recompute_tiers([(1 << 30, mixed)])
    sharding["recompute_plan"] = model.use_recompute_for(100)
    loss, outputs = passes(model, batch_for(rank, vocab))
    loss.backward()  # FSDP2 averages gradients over ranks: the reference divides by W
    gathered = [None] * world
    dist.all_gather_object(gathered, {k: v.detach() for k, v in outputs.items()})
    grads = named_grads(model)
    merged = {a: dict(merged_weights(model, a)) for a in ("actor", "critic")}
    states = {a: adapter_state(model, a) for a in ("actor", "critic")}

    # save under FSDP2, zero the sharded adapters, load back
    folders = {a: out / "saved" / a / "lora_adapter" for a in ("actor", "critic")}
    for adapter, folder in folders.items():
        save_adapter(model, adapter, folder)
    before = {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for param in model.actor_parameters() + model.critic_parameters():
            param.zero_()
    for adapter, folder in folders.items():
        load_adapter(model, adapter, folder)
    after = {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters() if p.requires_grad}
    sharded_seconds = time.perf_counter() - started

    if rank == 0:
        report = {"world_size": world, "sharded_seconds": sharded_seconds, **sharding,
                  **against_unsharded(base, vocab, world, gathered, grads, merged, states, before, after)}
        report["total_seconds"] = time.perf_counter() - started
        (out / "report.json").write_text(json.dumps(report, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
