"""The step's memory figures are the trainer's: PyTorch counts a colocated engine's weights and KV
cache as allocated even while the engine sleeps (vLLM's pool keeps its addresses; on the H200 a
tiny model's update phases showed the 0.3-utilisation engine's 41.9 GiB), so the per-phase peaks
leave the engine's allocation out; the rollout's card figures pass through."""

from __future__ import annotations

import pytest

from atlas_lightning.ppo.metrics import memory_metrics


def test_phase_peaks_leave_the_engines_allocation_out():
    phases = {"peak_allocated_gib/update_actor": 43.03, "peak_reserved_gib/update_actor": 43.25,
              "peak_allocated_gib/values": 42.16}
    rollout = {"engine_allocated_gib": 41.9, "card_used_gib/gen": 45.4, "card_used_gib/asleep": 3.55}
    out = memory_metrics(phases, rollout)
    assert out["memory/peak_allocated_gib/update_actor"] == pytest.approx(1.13)
    assert out["memory/peak_reserved_gib/update_actor"] == pytest.approx(1.35)
    assert out["memory/peak_allocated_gib/values"] == pytest.approx(0.26)
    assert out["memory/card_used_gib/gen"] == 45.4 and out["memory/card_used_gib/asleep"] == 3.55
    assert out["memory/engine_allocated_gib"] == 41.9


def test_without_an_engine_or_off_cuda_nothing_changes():
    assert memory_metrics({"peak_allocated_gib/update_actor": 12.0}, {}) == {
        "memory/peak_allocated_gib/update_actor": 12.0}
    assert memory_metrics({}, {}) == {}
