"""``bench head-dtype``: each head's distance from a float64 reference of the same bf16 operands
(the float32 head exact within float32's accumulation, the rounded head off by hundredths at
logits of 30-40), its JSON file, and a bad option refused before anything runs."""

import json

import pytest

from atlas_lightning.bench import head_dtype


def test_the_float32_head_is_exact_and_the_rounded_head_is_off_by_the_bf16_grid(tmp_path, capsys):
    out = tmp_path / "head.json"
    assert head_dtype.main(["--device", "cpu", "--tokens", "96", "--hidden", "64", "--vocab", "400",
                            "--chunk", "40", "--reps", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report == json.loads(capsys.readouterr().out)
    assert report["largest_logit"] > 25
    assert report["heads"]["float32"]["max_abs_gap"] < 1e-4
    assert report["heads"]["model"]["mean_abs_gap"] > 1e-2
    assert report["heads"]["model"]["max_abs_gap"] < 0.25  # bf16 spaces logits of 32-64 by 0.25


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "0"], "must be at least 1"),
    (["--logit-scale", "0"], "--logit-scale above 0"),
    (["--device", "cuda:0"], "no CUDA device here"),
])
def test_bad_options_are_refused(argv, message, capsys, tmp_path):
    import torch

    if argv[0] == "--device" and torch.cuda.is_available():
        pytest.skip("this machine has a card")
    with pytest.raises(SystemExit) as exit_info:
        head_dtype.main([*argv, "--out", str(tmp_path / "x.json")])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
