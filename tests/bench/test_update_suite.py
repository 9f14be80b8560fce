"""``update_suite``: the steps it runs (and refuses), and the summary table it prints from the
update benchmark's JSON files. (A tiny end-to-end run takes ~3 CPU-minutes: the torch Gated
DeltaNet; ``test_bench_smoke.py`` runs the update benchmark itself.)"""

from __future__ import annotations

import json

import pytest

from atlas_lightning.bench import update_suite


def _labels(argv):
    return [label for label, *_ in update_suite.parse_args(argv)[1]]


def test_steps_selected_and_refused(monkeypatch, tmp_path):
    assert _labels([]) == ["27b", "dense", "27b-baseline"]  # dense-torch only when named
    assert _labels(["--only", "dense-torch,27b"]) == ["27b", "dense-torch"]
    monkeypatch.setattr(update_suite, "fla_test", lambda: pytest.fail("ran before the options were checked"))
    with pytest.raises(SystemExit) as exit_:
        update_suite.main(["--only", "dense,nope", "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2 and not (tmp_path / "out").exists()


def test_the_recorded_batch_goes_to_the_dense_steps_alone():
    steps = dict((label, argv) for label, argv, *_ in update_suite.parse_args(
        ["--only", "27b,dense,dense-torch", "--batch-from", "/runs/b/artifacts/h200-8b/train/step_1"])[1])
    for label in ("dense", "dense-torch"):
        at = steps[label].index("--batch-from")
        assert steps[label][at + 1] == "/runs/b/artifacts/h200-8b/train/step_1"
    assert "--batch-from" not in steps["27b"]
    # the recorded run's kernels unless named; dense-torch names torch's
    assert "--elementwise-kernels" not in steps["dense"]
    assert steps["dense-torch"][steps["dense-torch"].index("--elementwise-kernels") + 1] == "torch"


def test_tiny_swaps_in_toy_shapes():
    args, steps = update_suite.parse_args(["--tiny", "--only", "27b,dense"])
    for _, argv, needs, keep in steps:
        assert argv[0] == "--tiny" and (needs, keep) == (0, 0)
        assert not {"qwen3_6_27b", "dense8b", "qwen3_6_27b=16"} & set(argv)
    assert "tiny_hybrid=4" in steps[0][1] and "tiny" in steps[1][1]


def test_summary_rows_from_the_step_files(tmp_path):
    update = {"median_s": 2.0, "tokens_per_s": 1000.0, "useful_mfu": 0.25, "peak_gib": 10.0}
    model = {"ours": {"update": update, "options": {"layer_recompute": ["layer", "none", "none"]}},
             "batch": {"ours": {"update": {"seconds": 30.0, "tokens_per_s": 9000.0, "useful_mfu": 0.48,
                                           "peak_gib": 59.6},
                                "attempts": [{"budget": 16384, "layer_recompute": ["mixer", "mixer"]}]}}}
    (tmp_path / "r-dense.json").write_text(json.dumps({"models": {"dense8b": model}}))
    rows = update_suite.summary_rows(tmp_path, "r")
    assert rows[1] == ("dense8b", "ours", "2.00", "1000", "25.0%", "10.0", "layerx1,nonex2")
    assert rows[2] == ("dense8b batch (dense)", "ours", "30.00", "9000", "48.0%", "59.6", "16384 mixerx2")
    assert len(rows) == 3
