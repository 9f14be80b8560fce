"""The benchmark's plan figure for a sweep config (``bench/plan_check.py``) is computed through
the typed config the planner reads, and stays near what the H200 measured for that config: the
27B's first 4 layers with none or every layer checkpointed, and the dense 8B's first 4 under each
recompute policy (the per-policy terms ``model.checkpoint_layers=auto`` chooses from)."""

from __future__ import annotations

import pytest

from atlas_lightning.bench.plan_check import plan_tensors_gib
from atlas_lightning.bench.shapes import SHAPES

# bench run 13 on the H200: the 27B shape's first 4 layers, fla kernels, 46,950 packed tokens,
# critic + actor update, peak allocated GiB with no layer / every layer recomputed
MEASURED_GIB = {0: 52.2, 4: 24.8}


@pytest.mark.parametrize("checkpoint_layers", sorted(MEASURED_GIB))
def test_sweep_plan_figure_is_near_the_cards_peak(checkpoint_layers):
    shape = SHAPES["qwen3_6_27b"]
    predicted = plan_tensors_gib(shape.config, shape.arch, 4, 46950, checkpoint_layers, "fla")
    assert predicted == pytest.approx(MEASURED_GIB[checkpoint_layers], rel=0.10)


# bench run 13 on the H200 (results/run13-dense.json): the dense 8B's first 4 layers, 46,950 packed
# tokens, critic + actor update, every layer under one policy, peak allocated GiB
MEASURED_DENSE_GIB = {"none": 32.2, "mixer": 25.3, "mlp": 23.6, "layer": 15.1}


@pytest.mark.parametrize("policy", sorted(MEASURED_DENSE_GIB))
def test_each_recompute_policys_figure_is_near_the_cards_peak_and_not_below_it(policy):
    shape = SHAPES["dense8b"]
    predicted = plan_tensors_gib(shape.config, shape.arch, 4, 46950, 0, "fla", policy=policy)
    measured = MEASURED_DENSE_GIB[policy]
    print(policy, f"{predicted:.2f} GiB planned, {measured} measured")
    assert measured <= predicted <= measured * 1.16  # on the safe side: auto sizes the update from these
