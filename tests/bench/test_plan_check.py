"""The benchmark's plan figure for a sweep config (``bench/plan_check.py``) is computed through
the typed config the planner reads, and stays near what the H200 measured for that config."""

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
