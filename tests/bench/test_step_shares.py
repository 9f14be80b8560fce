"""The step benchmark's shares (``bench.step.build_report``) from a step's logged phases and
callback seconds: generation, update compute, the rest, and validation and the checkpoint apart,
each amortised over its period (``trainer.val_every`` / ``trainer.save_every``). The figures are
built by hand here so that every share can be checked against arithmetic done independently."""

from __future__ import annotations

import json

import pytest

from atlas_lightning.bench.step import add_fit_edges, build_report
from atlas_lightning.config import compose


def test_validation_and_checkpoint_are_apart_and_amortised_over_their_periods():
    cfg = compose(["experiment=tiny-cpu", "trainer.total_steps=10", "trainer.val_every=5", "trainer.save_every=2"])
    phases = {"gen": 10.0, "sleep": 1.0, "assemble": 0.5, "old_log_prob": 4.0, "values": 4.0, "adv": 0.5,
              "update_critic": 30.0, "update_actor": 30.0, "wake": 0.5, "update_weights": 2.5}  # the sync: 3 s
    callbacks = {"ValidationCallback": 8.0, "StepCheckpoint": 6.0}
    wall = 100.0  # 10 gen + 68 update + 8 validation + 6 checkpoint + 8 of everything else
    report = build_report(cfg, {1: {f"timing_s/{p}": s for p, s in phases.items()}}, rollout_start={1: 0.0},
                          ended=wall, callback_s={1: callbacks}, lengths={1: [100, 200]}, generated={1: 150},
                          replayed={})
    shares = report["steps"][0]["shares"]
    assert shares["generation"] == pytest.approx(0.10) and shares["update_compute"] == pytest.approx(0.68)
    assert shares["validation"] == pytest.approx(0.08) and shares["checkpoint"] == pytest.approx(0.06)
    assert shares["overhead"] == pytest.approx(0.08)
    # the weight sync's 3 s are the step's own phases, not the unexplained rest (Lightning's loop)
    assert report["steps"][0]["other_s"] == pytest.approx(100.0 - 83.0 - 14.0)
    assert report["steps"][0]["other_parts"] == {"rollout": None, "training_step": None, "loop": None}
    # a typical step: 86 s of gen, update and the rest, plus 8/5 s of validation and 6/2 s of checkpoint
    periodic = 8.0 / 5 + 6.0 / 2
    assert shares["overhead_with_periodic_amortised"] == pytest.approx((8.0 + periodic) / (86.0 + periodic))


def test_tokens_per_gpu_second_counts_every_token_once_over_the_runs_gpus():
    """NeMo-RL's tokens/s/GPU: all trajectories' tokens / (step seconds x GPUs), the step as run,
    without its validation and checkpoint, and with those amortised over their periods."""
    cfg = compose(["experiment=tiny-cpu", "trainer.total_steps=10", "trainer.val_every=5", "trainer.save_every=2"])
    callbacks = {"ValidationCallback": 8.0, "StepCheckpoint": 6.0}
    report = build_report(cfg, {1: {"timing_s/gen": 10.0}}, rollout_start={1: 0.0}, ended=100.0,
                          callback_s={1: callbacks}, lengths={1: [1000, 3000]}, generated={1: 150}, replayed={})
    rate = report["steps"][0]["tokens_per_s_per_gpu"]
    gpus = int(cfg.layout.gpus)
    assert rate["gpus"] == gpus
    assert rate["step"] == pytest.approx(4000 / (100.0 * gpus))
    assert rate["without_periodic"] == pytest.approx(4000 / (86.0 * gpus))
    assert rate["amortised"] == pytest.approx(4000 / ((86.0 + 8.0 / 5 + 6.0 / 2) * gpus))
    # the step goals' periods, the report's: a checkpoint every step, validation every 5
    assert rate["report_periods"] == pytest.approx(4000 / ((86.0 + 8.0 / 5 + 6.0) * gpus))


def test_the_card_line_splits_what_pytorch_holds_from_the_rest_of_the_card():
    from atlas_lightning.bench.step_markdown import _card_split

    memory = {"card_used_gib/gen": 78.67, "torch_reserved_gib/gen": 35.0, "torch_allocated_gib/gen": 25.5,
              "card_used_gib/asleep": 35.06}  # asleep from a run before the split: the card alone
    assert _card_split(memory) == ("at generation the card held 78.67 GiB (PyTorch here: 35.00 reserved, 25.50 "
                                   "allocated); asleep the card held 35.06 GiB")


def test_other_is_split_between_the_rollout_call_the_training_step_and_the_loop():
    """The rollout call took 12.5 s of which its phases 11.5; training_step 72 s of which its
    phases 71.5 (old_log_prob .. update_weights): 1 + 0.5 of ``other``'s 3 s, the loop the rest."""
    cfg = compose(["experiment=tiny-cpu", "trainer.total_steps=1"])
    phases = {"gen": 10.0, "sleep": 1.0, "assemble": 0.5, "old_log_prob": 4.0, "values": 4.0, "adv": 0.5,
              "update_critic": 30.0, "update_actor": 30.0, "wake": 0.5, "update_weights": 2.5}
    wall = 100.0  # 83 of phases, 14 of callbacks: 3 of other
    report = build_report(cfg, {1: {f"timing_s/{p}": s for p, s in phases.items()} | {"sync_s/export": 1.25}},
                          rollout_start={1: 0.0}, ended=wall, callback_s={1: {"StepCheckpoint": 14.0}},
                          lengths={1: [100, 200]}, generated={1: 150}, replayed={}, rollout_s={1: 12.5},
                          training_step_s={1: 72.0})
    row = report["steps"][0]
    assert row["other_s"] == pytest.approx(3.0)
    assert row["other_parts"] == pytest.approx({"rollout": 1.0, "training_step": 0.5, "loop": 1.5})
    assert row["sync_s"] == {"export": 1.25}


def test_the_cards_rate_at_the_steps_end_gives_the_updates_mfu_beside_the_set_up_rates(orchestrator_dir):
    """A card at half its set-up matmul rate by the step's end doubles the updates' MFU reckoned
    on that rate; the seconds spent measuring it are the benchmark's, out of the step's wall."""
    from atlas_lightning.bench.step_markdown import markdown

    cfg = compose(["experiment=tiny-cpu", "trainer.total_steps=1", f"model.path={orchestrator_dir}"])
    phases = {"gen": 10.0, "update_critic": 30.0, "update_actor": 30.0}
    report = build_report(cfg, {1: {f"timing_s/{p}": s for p, s in phases.items()}}, rollout_start={1: 0.0},
                          ended=100.0, callback_s={}, lengths={1: [100, 200]}, generated={1: 150}, replayed={},
                          responses={1: [50, 100]}, peak_tflops=800.0, card_tflops={1: 400.0},
                          excluded_s={1: 5.0})
    row = report["steps"][0]
    assert row["wall_s"] == pytest.approx(95.0)
    assert row["card_tflops_after"] == 400.0
    for phase in ("update_critic", "update_actor"):
        assert row["useful_mfu_at_card_rate_after"][phase] == pytest.approx(2 * row["useful_mfu"][phase])
    assert "matmul rate at the step's end: 400.0 TFLOP/s (at set-up, the MFU column's: 800.0)" in markdown(report)
    # off CUDA nothing is measured, and nothing is said
    bare = build_report(cfg, {1: {f"timing_s/{p}": s for p, s in phases.items()}}, rollout_start={1: 0.0},
                        ended=100.0, callback_s={}, lengths={1: [100, 200]}, generated={1: 150}, replayed={},
                        responses={1: [50, 100]}, peak_tflops=800.0, card_tflops={1: None})
    assert "useful_mfu_at_card_rate_after" not in bare["steps"][0] and "step's end" not in markdown(bare)


def test_only_the_named_steps_updates_run_under_the_profiler_and_the_report_says_what_it_found(monkeypatch):
    """``profile_update_step=2``: step 1's and 3's updates run as they are, step 2's critic and
    actor each through ``probes.profile_call``; the report and its markdown carry each role's
    kernels and the card's idle share. (The profiler itself needs a card: stood in for here.)"""
    from atlas_lightning.bench import probes
    from atlas_lightning.bench.step import StepBenchCallback
    from atlas_lightning.bench.step_markdown import _profile_lines

    profiled = []

    def fake_profile_call(fn, top=20, host_ops=False):
        profiled.append(True)
        return fn(), {"wall_s_under_profiler": 10.0, "device_s": 9.0, "idle_share": 0.1,
                      "categories": {"gemm": {"s": 6.0, "share": 6 / 9}, "copies": {"s": 3.0, "share": 1 / 3}}}

    monkeypatch.setattr(probes, "profile_call", fake_profile_call)

    class Module:
        def _update(self, role, data, nonfinite):
            return {f"{role}/ran": data}

    module, callback = Module(), StepBenchCallback(out="/tmp/x", profile_update_step=2)
    callback._profile_updates(module)
    for step in (1, 2, 3):
        callback._step_now = step
        assert module._update("critic", step, {}) == {"critic/ran": step}
        assert module._update("actor", step, {}) == {"actor/ran": step}
    assert len(profiled) == 2 and set(callback.update_profile) == {"critic", "actor"}
    lines = _profile_lines({"step": 2, **callback.update_profile})
    assert lines[1] == ("step 2's update_actor under the profiler: 10.00 s, kernels 9.00 s, the card idle 10.0% "
                        "(gemm 6.00 s, copies 3.00 s); the allocator: -")
    assert _profile_lines({}) == []


def test_fit_edges_are_added_to_this_call_s_report_only(tmp_path):
    """``add_fit_edges``: the opening and closing from the callback's stamps and fit's call and
    return; a report an earlier run left in the folder is not touched."""
    report = {"name": "r", "steps": [], "plain_generate": {}, "environment": {},
              "fit_stamps": {"first_rollout_at": 1_000.0, "train_ended_at": 1_300.0}}
    path = tmp_path / "step_bench.json"
    path.write_text(json.dumps(report))
    assert add_fit_edges(tmp_path, called=1_100.0, returned=1_400.0) is None  # an earlier run's report
    assert "fit_edges_s" not in json.loads(path.read_text())
    assert add_fit_edges(tmp_path, called=880.0, returned=1_315.5) == {"opening": 120.0, "closing": 15.5}
    assert json.loads(path.read_text())["fit_edges_s"] == {"opening": 120.0, "closing": 15.5}
    assert "opening 120.0 s" in (tmp_path / "step_bench.md").read_text()
    assert add_fit_edges(tmp_path / "none", called=0.0, returned=1.0) is None
