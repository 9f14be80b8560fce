"""``bench depth-rounding``: its rows against an independent computation, its float32 control, and
its refusal of bad options."""

from __future__ import annotations

import json

import torch

from atlas_lightning.bench import depth_rounding


def test_rows_match_a_direct_computation(capsys):
    assert depth_rounding.main(["--depths", "2", "--sequences", "1", "--tokens", "24", "--sublayers"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["model"], r.get("float32")) for r in rows] == [
        ("hybrid", None), ("dense", None), ("hybrid", "gated_deltanet"), ("hybrid", "attention"),
        ("hybrid", "mlp"), ("hybrid", "norms")]
    ids = torch.randint(0, 8192, (1, 24), generator=torch.Generator().manual_seed(1))
    model = depth_rounding.build("hybrid", 2).eval()
    assert model.config.layer_types == ["linear_attention", "full_attention"]
    with torch.no_grad():
        full = model(input_ids=ids).logits.float().log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None])[..., 0]
        low = model.to(torch.bfloat16)(input_ids=ids).logits.float().log_softmax(-1)[0, :-1]
    gap = (low.gather(-1, ids[0, 1:, None])[..., 0] - full).abs()
    assert abs(rows[0]["mean"] - gap.mean().item()) < 1e-6 and rows[0]["mean"] > 0


def test_a_sublayer_kept_in_float32_computes_in_float32():
    """``in_float32``: a bf16 model's module computes from its bf16 input in float32 and hands on
    the float32 result rounded once to bf16."""
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    kept = torch.nn.Sequential(*[torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64)])
    kept.load_state_dict(reference.state_dict())
    depth_rounding.in_float32(kept)
    x = torch.randn(4, 64).to(torch.bfloat16)
    out = kept(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, reference(x.float()).to(torch.bfloat16))
    assert not torch.equal(out, reference.to(torch.bfloat16)(x))  # bf16 throughout rounds elsewhere


def test_bad_options_exit_2(capsys):
    assert depth_rounding.main(["--depths", "0"]) == 2
    assert "--depths >= 1" in capsys.readouterr().err


def test_full_width_is_the_report_models_shapes():
    hybrid, dense = depth_rounding.config("hybrid", 8, "full"), depth_rounding.config("dense", 8, "full")
    assert (hybrid.hidden_size, hybrid.num_hidden_layers, hybrid.linear_num_value_heads) == (5120, 8, 48)
    assert hybrid.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    assert (dense.hidden_size, dense.num_hidden_layers, dense.model_type) == (4096, 8, "qwen3")


def test_sublayers_at_full_width_are_refused(capsys):
    assert depth_rounding.main(["--width", "full", "--sublayers"]) == 2
    assert "--width narrow only" in capsys.readouterr().err
