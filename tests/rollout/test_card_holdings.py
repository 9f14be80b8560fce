"""What a failed wake names (``rollout/engines/card_holdings.largest_live``): the live tensors of
the device over the floor, grouped by dtype and shape, largest total first."""

from __future__ import annotations

import torch

from atlas_lightning.rollout.engines.card_holdings import largest_live, storages


def test_the_largest_live_tensors_are_named_by_shape_with_their_total():
    big = [torch.zeros(1024, 1024, 18) for _ in range(2)]  # 72 MiB each
    weight = torch.nn.Parameter(torch.zeros(1024, 1024, 40))  # 160 MiB
    small = torch.zeros(1024)  # under the floor: not named
    text = largest_live(torch.device("cpu"), floor_mib=64)
    first, second = "1 x float32[1024, 1024, 40] param = 0.16 GiB", "2 x float32[1024, 1024, 18] = 0.14 GiB"
    assert text.startswith("largest live tensors: ") and first in text and second in text
    assert text.index(first) < text.index(second)  # the largest total first
    assert "[1024] " not in text and "float32[1024]" not in text
    del big, weight, small
    assert largest_live(torch.device("cpu"), floor_mib=4096) == "no live tensor of 4096 MiB or more"


def test_the_engines_own_tensors_are_left_out():
    """What an engine allocated at its start (``storages`` before and after) is not named as the
    trainer's, even where it is the largest."""
    device = torch.device("cpu")
    before = storages(device)
    engine_cache = torch.zeros(1024, 1024, 64)  # 256 MiB: the engine's, made at its start
    engine_own = frozenset(storages(device) - before)
    trainer = torch.zeros(1024, 1024, 20)  # 80 MiB: the trainer's, made later
    text = largest_live(device, floor_mib=64, exclude=engine_own)
    assert "float32[1024, 1024, 20] = 0.08 GiB" in text
    assert "[1024, 1024, 64]" not in text
    assert "[1024, 1024, 64]" in largest_live(device, floor_mib=64)
    del engine_cache, trainer


class _NoData(torch.Tensor):
    """A tensor subclass without data (as fake and functional tensors are): its storage has no pointer."""

    @staticmethod
    def __new__(cls, shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32, device="cpu")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)


def test_tensors_without_data_are_passed_over():
    """The walk meets whatever the collector holds: a tensor without data is neither named nor fatal."""
    device = torch.device("cpu")
    no_data = _NoData((1024, 1024, 100))
    real = torch.zeros(1024, 1024, 20)  # 80 MiB
    assert "float32[1024, 1024, 20] = 0.08 GiB" in largest_live(device, floor_mib=64)
    assert "[1024, 1024, 100]" not in largest_live(device, floor_mib=64)
    assert real.untyped_storage().data_ptr() in storages(device)
    del no_data, real
