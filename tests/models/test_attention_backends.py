"""The trainer's attention chooses its kernel as PyTorch would where nothing was switched off
(``models/attention.py``): vLLM's CUDA platform module turns cuDNN's attention off for the whole
process at import, which put ``fit`` on other kernels than the update benchmark. Here that switch
is made as vLLM makes it; every call of ``sdpa_varlen`` still sees every backend enabled, packed
and padded, forward and a checkpointed layer's replay in the backward, and the process's flags
are as vLLM left them after each call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from atlas_lightning.models import attention

#: Each backend's flag: what reads it, what sets it.
FLAGS = (("cudnn_sdp_enabled", "enable_cudnn_sdp"), ("flash_sdp_enabled", "enable_flash_sdp"),
         ("mem_efficient_sdp_enabled", "enable_mem_efficient_sdp"), ("math_sdp_enabled", "enable_math_sdp"))


def _flags() -> tuple[bool, ...]:
    return tuple(getattr(torch.backends.cuda, read)() for read, _ in FLAGS)


@pytest.fixture
def cudnn_switched_off():
    before = _flags()
    torch.backends.cuda.enable_cudnn_sdp(False)  # what vllm/platforms/cuda.py does at import
    yield
    for (_, setter), value in zip(FLAGS, before):
        getattr(torch.backends.cuda, setter)(value)


def test_every_backend_is_enabled_inside_the_trainers_attention_and_the_process_flags_are_kept(
        cudnn_switched_off, monkeypatch):
    seen = []
    original = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(_flags())
        return original(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    module = torch.nn.Module()
    lengths = (3, 5)
    q, k, v = (torch.randn(1, 2, sum(lengths), 4, requires_grad=True) for _ in range(3))

    def layer(q, k, v):
        return attention.sdpa_varlen_attention_forward(module, q, k, v, None, **{attention.SEQ_LENS_KWARG: lengths})[0]

    checkpoint(layer, q, k, v, use_reentrant=False).sum().backward()  # forward, then its replay
    attention.sdpa_varlen_attention_forward(module, q[:, :, :4], k[:, :, :4], v[:, :, :4], None)  # padded rows
    assert len(seen) == 2 * len(lengths) + 1
    assert all(flags == (True, True, True, True) for flags in seen), seen
    assert _flags()[0] is False  # vLLM's choice, for vLLM's own calls


def test_each_attention_module_records_the_backend_its_first_call_ran(cudnn_switched_off):
    """What ``chosen_backends`` reports is the dispatch's own answer for the call's tensors under
    the trainer's flags (here PyTorch's CPU flash kernel), once a module; none before a call."""
    from torch.nn.attention import SDPBackend

    modules = [torch.nn.Module(), torch.nn.Module()]
    assert attention.chosen_backends(modules) == []
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    torch.backends.cuda.enable_flash_sdp(False)  # switched off for the process: the trainer's call still has it
    attention.sdpa_varlen_attention_forward(modules[0], q, k, v, None, **{attention.SEQ_LENS_KWARG: (2, 4)})
    with attention._every_backend():
        expected = SDPBackend(torch._fused_sdp_choice(q, k, v, None, 0.0, True, enable_gqa=True)).name
    assert attention.chosen_backends(modules) == [expected] == ["FLASH_ATTENTION"]


def test_the_model_reports_the_backend_every_attention_layer_ran(tiny_model_dir, cudnn_switched_off):
    """``ActorCritic.attention_backends``: nothing before a pass; after one, what each attention
    layer of the model (built with ``sdpa_varlen``, as ``conf/model/tiny.yaml`` builds it) ran."""
    from atlas_lightning.config import LoraConfig
    from atlas_lightning.models.packing import pack_sequences
    from tests.model_builds import actor_critic

    model = actor_critic(tiny_model_dir, LoraConfig(rank=4, alpha=8, dropout=0.0, target_modules="all-linear"),
                         attn_implementation="sdpa_varlen")
    assert model.varlen_attention and model.attention_backends() == []
    sequences = [torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 5)]
    with torch.no_grad():
        model.actor_forward(pack_sequences(sequences, [2, 3]), temperature=1.0)
    layers = model._attention_modules()
    assert layers and all(getattr(m, attention.BACKEND_ATTR) == "FLASH_ATTENTION" for m in layers)
    assert model.attention_backends() == ["FLASH_ATTENTION"]
