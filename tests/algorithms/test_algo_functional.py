"""Masked reductions, and verl's entropy and log-probs (``verl_reference.py``, the tests'
reference), against plain-Python float64 references."""

import math

import pytest
import torch

from atlas_lightning.algorithms.functional import (
    clip_by_value,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from verl_reference import entropy_from_logits, logprobs_from_logits


def _selected(values, mask):
    return [v for row_v, row_m in zip(values, mask) for v, m in zip(row_v, row_m) if m]


def ref_mean(values, mask):
    chosen = _selected(values, mask)
    return sum(chosen) / (len(chosen) + 1e-8)


def ref_var(values, mask, unbiased):
    chosen = _selected(values, mask)
    mean = ref_mean(values, mask)
    var = sum((v - mean) ** 2 for v in chosen) / (len(chosen) + 1e-8)
    return var * len(chosen) / (len(chosen) - 1) if unbiased else var


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(4, 9, generator=g, dtype=torch.float64)
    mask = torch.ones(4, 9, dtype=torch.int64)
    mask[0, 3:5] = 0  # a tool span in the middle
    mask[1, 7:] = 0  # right padding
    mask[2] = 0  # a row with nothing selected
    # float64 mask: with an integer mask the count (+1e-8) is a float32 tensor, as in verl.
    return values, mask.double()


def test_masked_mean_and_sum_match_reference(batch):
    values, mask = batch
    v, m = values.tolist(), mask.tolist()
    assert masked_mean(values, mask).item() == pytest.approx(ref_mean(v, m), rel=1e-12)
    row_means = masked_mean(values, mask, axis=-1).tolist()
    for row in range(4):
        assert row_means[row] == pytest.approx(ref_mean([v[row]], [m[row]]), rel=1e-12, abs=1e-15)
    assert row_means[2] == 0.0  # empty selection: 0, not NaN
    assert masked_sum(values, mask).item() == pytest.approx(sum(_selected(v, m)), rel=1e-12)


def test_bool_int_and_float_masks_agree(batch):
    values, mask = batch
    for other in (mask.bool(), mask.long()):
        assert masked_mean(values, other).item() == pytest.approx(masked_mean(values, mask).item(), rel=1e-7)
        assert torch.allclose(masked_whiten(values, other), masked_whiten(values, mask), rtol=1e-7, atol=0)


def test_nan_outside_the_mask_does_not_leak(batch):
    values, mask = batch
    poisoned = values.masked_fill(mask == 0, float("nan"))
    assert masked_mean(poisoned, mask).item() == pytest.approx(masked_mean(values, mask).item(), rel=1e-15)
    assert torch.isfinite(masked_sum(poisoned, mask.bool(), axis=-1)).all()


@pytest.mark.parametrize("unbiased", [True, False])
def test_masked_var_matches_reference(batch, unbiased):
    values, mask = batch
    got = masked_var(values, mask, unbiased=unbiased).item()
    assert got == pytest.approx(ref_var(values.tolist(), mask.tolist(), unbiased), rel=1e-9)


def test_masked_var_needs_two_selected_elements():
    values = torch.tensor([[1.0, 2.0, 3.0]])
    with pytest.raises(ValueError, match="selects no element"):
        masked_var(values, torch.zeros(1, 3))
    with pytest.raises(ValueError, match="selects one element"):
        masked_var(values, torch.tensor([[0, 1, 0]]))
    assert masked_var(values, torch.tensor([[0, 1, 0]]), unbiased=False).item() == pytest.approx(0.0)


def test_masked_whiten_matches_reference_and_standardises(batch):
    values, mask = batch
    v, m = values.tolist(), mask.tolist()
    mean, var = ref_mean(v, m), ref_var(v, m, True)
    expected = [[(x - mean) / math.sqrt(var + 1e-8) for x in row] for row in v]
    got = masked_whiten(values, mask)
    assert got.flatten().tolist() == pytest.approx([x for row in expected for x in row], rel=1e-9)
    chosen = got[mask.bool()]
    assert chosen.mean().item() == pytest.approx(0.0, abs=1e-8)  # the 1e-8 in the count shifts it slightly
    assert chosen.std(unbiased=True).item() == pytest.approx(1.0, rel=1e-6)
    unshifted = masked_whiten(values, mask, shift_mean=False)
    assert torch.allclose(unshifted, got + mean, rtol=0, atol=1e-12)


def test_entropy_matches_reference():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [5.0, -1.0, 2.0, 0.5]], [[-30.0, 30.0, 0.0, 1.0], [1.0, 2.0, 3.0, 4.0]]], dtype=torch.float64)
    got = entropy_from_logits(logits)
    for b in range(2):
        for t in range(2):
            row = logits[b, t].tolist()
            top = max(row)
            z = sum(math.exp(x - top) for x in row)
            probs = [math.exp(x - top) / z for x in row]
            expected = -sum(p * math.log(p) for p in probs if p > 0)
            assert got[b, t].item() == pytest.approx(expected, rel=1e-10, abs=1e-12)
    assert got[0, 0].item() == pytest.approx(math.log(4))


def test_logprobs_match_reference_in_float_and_bf16():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 13, generator=g, dtype=torch.float64) * 4
    labels = torch.randint(0, 13, (3, 5), generator=g)
    got = logprobs_from_logits(logits, labels)
    for b in range(3):
        for t in range(5):
            row = logits[b, t].tolist()
            top = max(row)
            log_z = top + math.log(sum(math.exp(x - top) for x in row))
            assert got[b, t].item() == pytest.approx(row[labels[b, t]] - log_z, rel=1e-12, abs=1e-12)
    low = logprobs_from_logits(logits.to(torch.bfloat16), labels)
    assert low.dtype == torch.bfloat16
    assert torch.allclose(low.double(), got, atol=0.1)
    as_float = logprobs_from_logits(logits.float(), labels)
    assert torch.allclose(as_float.double(), got, atol=1e-5)


def test_logprobs_reject_mismatched_labels():
    with pytest.raises(ValueError, match="labels shape"):
        logprobs_from_logits(torch.zeros(2, 3, 7), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="logits must be"):
        logprobs_from_logits(torch.zeros(7), torch.zeros((), dtype=torch.long))


def test_clip_by_value_uses_tensor_bounds():
    x = torch.tensor([-5.0, 0.5, 5.0, 1.5])
    low = torch.tensor([-1.0, 0.0, 0.0, 2.0])
    high = torch.tensor([1.0, 1.0, 4.0, 3.0])
    assert clip_by_value(x, low, high).tolist() == [-1.0, 0.5, 4.0, 2.0]
