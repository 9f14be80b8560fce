"""The trainer's allocator mode across the engine's sleep (``trainer_allocator``): the flag
flips, the user's other allocator options survive every flip, and a user's explicit choice of
plain segments is kept. Read back from torch's live allocator configuration."""

import pytest
import torch

from atlas_lightning.rollout.engines import trainer_allocator

_get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
pytestmark = pytest.mark.skipif(_get is None, reason="this torch cannot read its allocator configuration")


@pytest.fixture
def live_conf(monkeypatch):
    """Start from a given live configuration and environment; restore torch's afterwards."""
    before = _get()
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)

    def start(conf, env=None):
        torch._C._accelerator_setAllocatorSettings(conf)
        if env is not None:
            monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", env)
    yield start
    torch._C._accelerator_setAllocatorSettings(before)


def _fields():
    return dict(field.split(":", 1) for field in _get().split(",") if field)


def test_flips_and_keeps_other_options(live_conf):
    live_conf("max_split_size_mb:512,garbage_collection_threshold:0.8")
    trainer_allocator.for_training()
    assert trainer_allocator.expandable()
    assert _fields() == {"max_split_size_mb": "512", "garbage_collection_threshold": "0.8",
                         "expandable_segments": "True"}
    trainer_allocator.for_engine()
    assert not trainer_allocator.expandable()
    assert _fields() == {"max_split_size_mb": "512", "garbage_collection_threshold": "0.8",
                         "expandable_segments": "False"}
    trainer_allocator.for_training()  # the next step's sleep
    assert trainer_allocator.expandable()


def test_the_users_plain_segments_are_kept(live_conf):
    live_conf("expandable_segments:False,max_split_size_mb:256", env="expandable_segments:False,max_split_size_mb:256")
    trainer_allocator.for_training()
    assert not trainer_allocator.expandable()
    assert _fields() == {"expandable_segments": "False", "max_split_size_mb": "256"}


def test_an_engine_never_sees_them_before_any_sleep(live_conf):
    live_conf("")
    trainer_allocator.for_engine()  # a wake before any sleep: nothing to switch off
    assert not trainer_allocator.expandable()
    assert _get() == ""
