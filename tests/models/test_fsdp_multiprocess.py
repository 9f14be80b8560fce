"""FSDP2 on real gloo processes: sharded passes, gradients, merged weights and adapter
save/load equal one unsharded process, at world sizes whose shards are uneven.

The dims (hidden 80, intermediate 136, vocab 131, LoRA rank 5) divide by none of 3 or 4,
so shards are uneven; at 4 ranks the rank-5 LoRA factors leave one rank an empty shard.
Each case starts ``fsdp_worker.py`` at W ranks (``tests/forked_ranks.py``) and asserts on the
report its rank 0 writes (see that file for what is compared).
"""

from __future__ import annotations

import pytest

DIMS = dict(hidden_size=80, intermediate_size=136, vocab_size=131)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "world_size, arch",
    [pytest.param(1, "qwen3", marks=pytest.mark.e2e), (2, "qwen3"), (3, "qwen3"), (3, "qwen3_5"),
     pytest.param(4, "qwen3_5", marks=pytest.mark.e2e)],
)
def test_sharded_equals_one_process(world_size, arch, tmp_path, fsdp_worker):
    report, seconds = fsdp_worker(world_size, arch, DIMS, tmp_path, timeout=180)
    print(f"world_size={world_size} arch={arch}: {seconds:.1f} s wall, worker {report['total_seconds']:.1f} s")

    assert report["world_size"] == world_size
    assert report["all_params_sharded"]  # the frozen base too
    assert report["recompute_plan"][:2] == ["mixer", "none"]  # the sharded passes ran a mixed plan
    if world_size > 1:
        assert report["uneven_params"] > 0
    if world_size == 4:
        assert report["empty_local_shards"] > 0  # rank-5 LoRA A over 4 ranks: chunks 2, 2, 1, none
    output_errors = {k: v for k, v in report.items() if k.startswith("err/") and k != "err/grads"}
    assert len(output_errors) == 4 * world_size
    assert max(output_errors.values()) <= 1e-5, output_errors
    assert report["grad_names_equal"] and report["grads_none"] == []
    assert report["err/grads"] <= 1e-6 * max(1.0, report["grad_scale"]) * 10, report["err/grads"]
    for adapter in ("actor", "critic"):
        assert report[f"merged/{adapter}/names_equal"]
        assert report[f"merged/{adapter}/dtypes_equal"]
        assert report[f"merged/{adapter}/max_err"] <= 1e-6, report[f"merged/{adapter}/max_err"]  # fp32 rounding
        assert report[f"merged/{adapter}/equals_unsharded_export"]
        assert report[f"merged/{adapter}/changed_tensors"] >= 14  # every LoRA-wrapped linear moved
        assert report[f"state/{adapter}/equal"]
    assert report["reload/equal"]
    prefix = "model.language_model." if arch == "qwen3_5" else "model."
    assert any(name.startswith(prefix + "layers.0") for name in report["checkpoint_name_example"])
    assert (tmp_path / "out" / "saved" / "critic" / "lora_adapter" / "value_head.safetensors").is_file()
