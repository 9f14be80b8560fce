"""Merged weights exact at FSDP2 world sizes 4 and 6 (README, "The separate layout"), on gloo processes.

ATLAS report 28's (the reproduced report's) six-rank layout got NaN entropies from wrong merged weights: FSDP2 shards every
parameter on dim 0 over the ranks, unevenly when a dim does not divide by 6. Here the dims
(hidden 74, MLP 130, vocabulary 131, LoRA rank 5; q_proj 64 and k/v 32 wide) divide by
neither 4 nor 6 wherever it matters, so shards are uneven and, for the rank-5 LoRA factors,
some ranks hold nothing. Each case runs the models room's worker (``tests/models/fsdp_worker.py``,
imported by path, unchanged) at W forked ranks (``tests/forked_ranks.py``): it shards an ActorCritic over W
ranks and compares, on rank 0, ``merged_weights`` of both adapters with the one-process export
bit for bit (and with peft's ``merge_and_unload()`` up to fp32 rounding), and the sharded
passes and gradients with one process.
"""

from __future__ import annotations

import pytest

DIMS = dict(hidden_size=74, intermediate_size=130, vocab_size=131)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size, arch", [pytest.param(4, "qwen3", marks=pytest.mark.e2e),
                                              pytest.param(6, "qwen3", marks=pytest.mark.e2e), (6, "qwen3_5")])
def test_merged_weights_exact_at_uneven_world_sizes(world_size, arch, tmp_path, fsdp_worker):
    for dim in DIMS.values():
        assert dim % world_size, f"{dim} divides by {world_size}: shards would be even"
    report, seconds = fsdp_worker(world_size, arch, DIMS, tmp_path, timeout=400)
    print(f"world_size={world_size} arch={arch}: {seconds:.1f} s")

    assert report["world_size"] == world_size
    assert report["all_params_sharded"] and report["uneven_params"] > 0
    assert report["empty_local_shards"] > 0  # rank-5 LoRA factors over 6 ranks: chunks 1,1,1,1,1,0
    for adapter in ("actor", "critic"):
        assert report[f"merged/{adapter}/names_equal"]
        assert report[f"merged/{adapter}/dtypes_equal"]
        assert report[f"merged/{adapter}/max_err"] <= 1e-6, report[f"merged/{adapter}/max_err"]  # fp32 rounding
        assert report[f"merged/{adapter}/equals_unsharded_export"]
        assert report[f"merged/{adapter}/changed_tensors"] >= 14  # every LoRA-wrapped linear moved
        assert report[f"state/{adapter}/equal"]
    # the sharded model computes what one process computes (no NaN, no drift)
    output_errors = {k: v for k, v in report.items() if k.startswith("err/") and k != "err/grads"}
    assert len(output_errors) == 4 * world_size
    assert max(output_errors.values()) <= 1e-5, output_errors
    assert report["err/grads"] <= 1e-5 * max(1.0, report["grad_scale"]), report["err/grads"]
    assert report["reload/equal"]
