"""The update's time lost to short micro-batches (``ppo/micro_timing.py``), on CPU timings."""

from __future__ import annotations

import pytest

from atlas_lightning.ppo.micro_timing import MicroTimer


def _timer(steps: list[tuple[int, float]], budget: int = 1000) -> MicroTimer:
    timer = MicroTimer("cpu", budget)
    timer._steps = [(n, 0.0, s) for n, s in steps]  # (tokens, start, end) as the CPU clock records them
    return timer


def test_short_micro_batches_cost_their_time_beyond_the_full_throughput():
    # full ones run at 1,000 tokens/s; the 200-token one took 0.5 s where 0.2 s would do
    out = _timer([(1000, 1.0), (950, 0.95), (200, 0.5)]).metrics("actor")
    assert out["perf/actor_micro_batches"] == [3.0]
    assert out["perf/actor_micro_fill"] == [pytest.approx((1000 + 950 + 200) / 3 / 1000)]
    assert out["perf/actor_short_time_share"] == [pytest.approx(0.3 / 2.45)]
    assert out["perf/actor_micro_tokens_max"] == [1000.0]
    assert out["perf/actor_micro_steps_s"] == [pytest.approx(2.45)]


def test_all_full_loses_nothing_and_no_full_one_compares_with_the_best():
    assert _timer([(1000, 1.0), (990, 0.99)]).metrics("critic")["perf/critic_short_time_share"] == [0.0]
    # none full: the best throughput (400 tokens in 0.2 s) is the reference
    out = _timer([(400, 0.2), (100, 0.1)]).metrics("critic")
    assert out["perf/critic_short_time_share"] == [pytest.approx(0.05 / 0.3)]


def test_a_timed_block_is_recorded_with_its_tokens():
    timer = MicroTimer("cpu", 10)
    with timer.step(7):
        sum(range(1000))
    (tokens, seconds), = timer.seconds()
    assert tokens == 7 and seconds > 0
    assert _timer([]).metrics("actor") == {"perf/actor_micro_batches": [], "perf/actor_micro_fill": [],
                                           "perf/actor_short_time_share": [], "perf/actor_micro_step_fixed_s": [],
                                           "perf/actor_micro_tokens_max": [], "perf/actor_micro_steps_s": []}


def test_a_micro_steps_fixed_cost_is_the_intercept_over_its_work():
    """seconds = 0.12 + 1e-5 x work, with 1% noise: the fit finds both; too few steps or too
    narrow a spread of work give none, and the metric is then empty."""
    works = [25600 * 2.71, 12800 * 2.41, 12800 * 2.41, 9600 * 2.1, 6400 * 2.1, 5120 * 2.0]
    noise = [1.01, 0.99, 1.0, 1.01, 0.99, 1.0]
    timer = _timer([(1000, (0.12 + 1e-5 * w) * e) for w, e in zip(works, noise)])
    timer._work = works
    fixed, per_work = timer.fixed_cost()
    assert fixed == pytest.approx(0.12, rel=0.25) and per_work == pytest.approx(1e-5, rel=0.05)
    assert timer.metrics("actor")["perf/actor_micro_step_fixed_s"] == [fixed]
    few = _timer([(1000, 1.0), (500, 0.5)])
    few._work = [1000.0, 500.0]
    narrow = _timer([(1000, 1.0), (990, 0.99), (980, 0.98)])
    narrow._work = [1000.0, 990.0, 980.0]
    assert few.fixed_cost() is None and narrow.fixed_cost() is None
    assert narrow.metrics("critic")["perf/critic_micro_step_fixed_s"] == []


def test_only_a_fixed_cost_above_zero_replaces_the_packers():
    """A fit whose intercept is zero (clamped from below) says the seconds are not linear in the
    work, not that micro-steps are free: the packer keeps the cost it had."""
    from atlas_lightning.ppo.micro_batches import MICRO_STEP_TOKENS, measured_step_tokens

    assert measured_step_tokens((0.12, 1e-5), MICRO_STEP_TOKENS) == pytest.approx(12_000)
    assert measured_step_tokens((0.0, 1e-5), 3_000.0) == 3_000.0
    assert measured_step_tokens(None, MICRO_STEP_TOKENS) == MICRO_STEP_TOKENS
