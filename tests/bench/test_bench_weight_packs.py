"""``merged_weight_packs``: every bucket one contiguous buffer, same bits as ``merged_weights``."""

from __future__ import annotations

import pytest
import torch

from atlas_lightning.models.weights import PACK_ALIGN, merged_weight_buckets, merged_weight_packs, merged_weights
from tests.model_builds import actor_critic

LORA = {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bucket_bytes", [1, 20_000, 10**9])
def test_packs_equal_merged_weights_bitwise(qwen3_base, randomize, dtype, bucket_bytes):
    model = actor_critic(qwen3_base, LORA, dtype=dtype)
    randomize(model)
    expected = list(merged_weights(model, "actor"))
    packs = list(merged_weight_packs(model, "actor", bucket_bytes))
    got = [pair for _, views in packs for pair in views]
    assert [n for n, _ in got] == [n for n, _ in expected]
    for (name, a), (_, b) in zip(got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.view(-1).view(torch.uint8) if a.dtype != torch.uint8 else a, b.reshape(-1).view(torch.uint8)), name
    # same grouping as the unpacked buckets, and every view lies inside its own buffer
    buckets = list(merged_weight_buckets(model, "actor", bucket_bytes))
    assert [[n for n, _ in b] for b in buckets] == [[n for n, _ in views] for _, views in packs]
    for buffer, views in packs:
        base = buffer.data_ptr()
        for _, view in views:
            offset = view.data_ptr() - base
            assert offset % PACK_ALIGN == 0 and offset + view.numel() * view.element_size() <= buffer.numel()


def test_packs_reject_bad_bucket(qwen3_base):
    with pytest.raises(ValueError, match="bucket_bytes=0 must be positive"):
        next(merged_weight_packs(actor_critic(qwen3_base, LORA), "actor", 0))
