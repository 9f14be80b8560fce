"""The plan against what memory-check measured on an H200 (``h200_memory_check.json``, written
from the run of ``device_memory_check.py`` whose command it records): for every one-card case
and phase, the planned tensor bytes are within 15 % of ``torch.cuda.max_memory_allocated``.

The cases: an 8B-shaped dense model at 8,192, 16,384 and 49,152 tokens with full activation
checkpointing and at 8,192 and 16,384 without (130 GiB measured at the last), and the first 8
layers of the Qwen3.6-27B shape (6 Gated DeltaNet layers on transformers' torch fallback, 2
gated full-attention layers) at 8,192 tokens with and without checkpointing. The dense terms
are analytic; the fallback's linear-attention factors were fitted on these two hybrid cases
(``planning/activations.py``), so the hybrid rows check the fit, not a prediction.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from atlas_lightning.planning import GIB, estimate

HERE = Path(__file__).resolve().parent
MEASURED = json.loads((HERE / "h200_memory_check.json").read_text())
TOLERANCE = 0.15


def _plan(case: dict, tmp_path):
    from device_memory_check import case_setup  # tests/scale is on sys.path through conftest

    cfg, shape, _, _ = case_setup(case["case"], tmp_path, case["attn"], "gpu")
    return estimate(shape, cfg, card_gib=139.8, linear_kernel="torch")


@pytest.mark.parametrize("case", MEASURED["cases"], ids=[c["case"] for c in MEASURED["cases"]])
def test_plan_within_15_percent_of_the_h200_peak(case, tmp_path):
    plan = _plan(case, tmp_path)
    errors = {}
    for name, measured in case["phases"].items():
        planned = plan.phase(name).tensors / GIB
        errors[name] = planned / measured["peak_allocated_gib"] - 1.0
        # what the phase starts from (weights, LoRA states) is predicted near exactly
        assert plan.phase(name).tensors - sum(plan.phase(name).sequential.values()) > 0
    print(case["case"], {k: f"{v:+.1%}" for k, v in errors.items()})
    assert max(abs(e) for e in errors.values()) <= TOLERANCE, errors


def test_resident_memory_is_what_the_card_held_before_each_phase(tmp_path):
    """Base weights + both adapters' fp32 params, grads and Adam moments: the measured start."""
    for case in MEASURED["cases"]:
        resident = sum(v for k, v in _plan(case, tmp_path).phase("update_actor").terms.items()
                       if k in ("base weights", "LoRA states (actor+critic)")) / GIB
        for measured in case["phases"].values():
            assert measured["start_gib"] == pytest.approx(resident, rel=0.02), case["case"]
