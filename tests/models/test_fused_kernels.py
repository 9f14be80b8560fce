"""Fused memory-bound kernels (``models/fused_kernels.py``, ``model.elementwise_kernels``).

* Everywhere: the key resolves to ``torch`` on a CPU (``auto``) and refuses ``liger`` there.
* Where CUDA, Triton and liger-kernel are present (skipped with the reason elsewhere): each
  fused kernel against the torch path it replaces, both against an fp64 reference on the same
  bf16 inputs (the fused error at most about the torch path's, both within bf16 rounding), and
  a whole model (Qwen3 and the hybrid Qwen3.5, packed, policies ``layer``/``mixer``/``mlp``/``none``) with ``liger`` against
  ``torch``: log-probs, values and LoRA gradients within bf16 rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from atlas_lightning.config import LoraConfig, ModelConfig
from atlas_lightning.models.fused_kernels import liger_problem, resolve

LORA = LoraConfig(rank=8, alpha=16, dropout=0.0, target_modules="all-linear")


def _cuda_problem():
    if not torch.cuda.is_available():
        return "no CUDA device"
    return liger_problem()


needs_liger = pytest.mark.skipif(_cuda_problem() is not None,
                                 reason=f"needs a CUDA device, Triton and liger-kernel: {_cuda_problem()}")


def test_key_resolves_to_torch_on_cpu_and_refuses_liger_there():
    assert ModelConfig().elementwise_kernels == "auto"
    assert resolve("auto", "cpu") == "torch"
    assert resolve("torch", "cuda") == "torch"
    with pytest.raises(ValueError, match="model.elementwise_kernels=liger cannot run here"):
        resolve("liger", "cpu")
    with pytest.raises(ValueError, match="is not one of auto, liger, torch"):
        resolve("triton", "cuda")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _within(fused: float, torch_path: float) -> bool:
    """bf16 outputs: the fused error no worse than about the torch path's, and under 1e-2."""
    return fused <= 2 * torch_path + 2e-3 and fused < 1e-2


@needs_liger
@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("shape", [(3000, 4096), (2, 1500, 8, 128)])
def test_rms_norm_against_torch_and_fp64(offset, shape):
    from atlas_lightning.models.fused_kernels import rms_norm
    from atlas_lightning.models.lean_activations import RMSNormFunction

    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(shape, device="cuda", generator=g) * 3).bfloat16().requires_grad_(True)
    weight = (1 + 0.1 * torch.randn(shape[-1], device="cuda", generator=g)).bfloat16()
    if offset:
        weight = weight - 1
    grad_y = torch.randn(shape, device="cuda", generator=g).bfloat16()

    x64 = x.detach().double().requires_grad_(True)
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    ref = normed * ((1 + weight.double()) if offset else weight.double())
    (ref_dx,) = torch.autograd.grad(ref, x64, grad_y.double())

    results = {}
    for name, fn in (("torch", lambda: RMSNormFunction.apply(x, weight, 1e-6, offset)),
                     ("liger", lambda: rms_norm(x, weight, 1e-6, offset))):
        y = fn()
        (dx,) = torch.autograd.grad(y, x, grad_y)
        assert y.dtype == dx.dtype == torch.bfloat16
        results[name] = (_rel(y, ref), _rel(dx, ref_dx))
    print(f"rms_norm offset={offset} {shape}: {results}")
    for i in range(2):
        assert _within(results["liger"][i], results["torch"][i]), results


@needs_liger
@pytest.mark.parametrize("lora", [True, False])
def test_swiglu_down_fused_against_torch_and_fp64(lora):
    from atlas_lightning.models.recompute import SwiGLUDownFunction

    g = torch.Generator(device="cuda").manual_seed(1)
    gate, up = ((torch.randn(2, 1000, 1536, device="cuda", generator=g) * 2).bfloat16() for _ in range(2))
    weight = (torch.randn(512, 1536, device="cuda", generator=g) / 40).bfloat16()
    a = (torch.randn(8, 1536, device="cuda", generator=g) / 40).requires_grad_(True) if lora else None
    b = (torch.randn(512, 8, device="cuda", generator=g) / 3).requires_grad_(True) if lora else None
    grad_y = torch.randn(2, 1000, 512, device="cuda", generator=g).bfloat16()

    leaves64 = [t.detach().double().requires_grad_(True) for t in (gate, up)]
    params64 = [t.detach().double().requires_grad_(True) for t in (a, b)] if lora else []
    h = F.silu(leaves64[0]) * leaves64[1]
    ref = F.linear(h, weight.double()) + (0.5 * F.linear(F.linear(h, params64[0]), params64[1]) if lora else 0)
    refs = [ref, *torch.autograd.grad(ref, leaves64 + params64, grad_y.double())]

    errors = {}
    for fused in (False, True):
        g_in, u_in = (t.clone().requires_grad_(True) for t in (gate, up))  # the fused backward writes over its saved inputs
        y = SwiGLUDownFunction.apply(g_in, u_in, weight, a, b, 0.5, fused)
        got = [y, *torch.autograd.grad(y, [g_in, u_in] + ([a, b] if lora else []), grad_y)]
        errors[fused] = [_rel(x, r) for x, r in zip(got, refs)]
    print(f"swiglu_down lora={lora}: torch {errors[False]}, fused {errors[True]}")
    for f, t in zip(errors[True], errors[False]):
        assert _within(f, t), errors


@needs_liger
def test_a_second_backward_through_the_fused_swiglu_is_refused():
    """The fused backward writes the gradients over the saved gate and up: a second backward
    through the same graph must stop (autograd's in-place error), not read them as activations."""
    from atlas_lightning.models.recompute import SwiGLUDownFunction

    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(64, 256, device="cuda", generator=g).bfloat16().requires_grad_(True)
    gate, up = x * 2, x - 1  # intermediates, as gate_proj(x) and up_proj(x) are
    weight = (torch.randn(128, 256, device="cuda", generator=g) / 16).bfloat16()
    y = SwiGLUDownFunction.apply(gate, up, weight, None, None, 1.0, True).float().sum()
    y.backward(retain_graph=True)
    assert torch.isfinite(x.grad.float()).all()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@needs_liger
def test_swiglu_mlp_fused_against_torch():
    from atlas_lightning.models.recompute import SwiGLUMLPFunction

    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(1500, 512, device="cuda", generator=g).bfloat16().requires_grad_(True)
    weights = [(torch.randn(o, i, device="cuda", generator=g) / 20).bfloat16() for o, i in ((1536, 512), (1536, 512), (512, 1536))]
    loras = [((torch.randn(8, w.shape[1], device="cuda", generator=g) / 20).requires_grad_(True),
              (torch.randn(w.shape[0], 8, device="cuda", generator=g) / 3).requires_grad_(True)) for w in weights]
    flat = [t for w, (a, b) in zip(weights, loras) for t in (w, a, b)]
    leaves = [x] + [t for pair in loras for t in pair]
    grad_y = torch.randn(1500, 512, device="cuda", generator=g).bfloat16()
    outs = {}
    for fused in (False, True):
        y = SwiGLUMLPFunction.apply(x, *flat, 0.5, 2.0, 0.25, fused)
        outs[fused] = [y, *torch.autograd.grad(y, leaves, grad_y)]
    errors = [_rel(f, t) for f, t in zip(outs[True], outs[False])]
    print(f"swiglu_mlp fused against torch: {errors}")
    assert max(errors) < 1e-2, errors


@needs_liger
def test_rotary_against_torch_and_fp64():
    from atlas_lightning.models.fused_kernels import apply_rotary, torch_rotary_reference

    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(1, 32, 2000, 128, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, 8, 2000, 128, device="cuda", generator=g).bfloat16()
    # as transformers builds them: (B, L, D), cat(freqs, freqs), in the model dtype
    freqs = torch.arange(2000, device="cuda").double()[:, None] / 1e6 ** (torch.arange(64, device="cuda").double() / 64)
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    gq, gk = torch.randn_like(q), torch.randn_like(k)

    q64, k64 = (t.double().requires_grad_(True) for t in (q, k))
    refs = list(torch_rotary_reference(q64, k64, cos.double(), sin.double()))
    refs += torch.autograd.grad(refs, [q64, k64], [gq.double(), gk.double()])
    errors = {}
    for name, fn in (("torch", torch_rotary_reference), ("liger", apply_rotary)):
        # the model's layout: (B, L, H, D) buffers seen as (B, H, L, D); liger rotates them in place
        qi = q.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True)
        ki = k.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True)
        q_in, k_in = qi * 1, ki * 1  # non-leaf inputs, as in the model (the q/k norms' outputs)
        outs = list(fn(q_in, k_in, cos, sin))
        outs += torch.autograd.grad(outs, [qi, ki], [gq, gk])
        errors[name] = [_rel(o, r) for o, r in zip(outs, refs)]
    print(f"rotary: {errors}")
    for f, t in zip(errors["liger"], errors["torch"]):
        assert _within(f, t), errors


@needs_liger
@pytest.mark.parametrize("base_name", ["qwen3_base", "qwen3_5_base"])
@pytest.mark.parametrize("policy", ["layer", "mixer", "mlp", "none"])
def test_model_with_liger_equals_torch_path_within_bf16_rounding(base_name, policy, request, randomize):
    from atlas_lightning.models import attention  # noqa: F401  (registers sdpa_varlen)
    from tests.model_builds import actor_critic
    from atlas_lightning.models.packing import pack_sequences

    base = request.getfixturevalue(base_name)
    g = torch.Generator().manual_seed(0)
    lengths, prompts = (90, 40, 130, 61), (30, 20, 50, 10)
    packed = pack_sequences([torch.randint(0, 128, (n,), generator=g) for n in lengths], prompts).to("cuda")
    runs = {}
    for kernels in ("torch", "liger"):
        model = actor_critic(base, LORA, dtype="bfloat16", device="cuda", attn_implementation="sdpa_varlen",
                            gradient_checkpointing=True, layer_recompute=[policy, "none"], logprob_chunk_tokens=64,
                            elementwise_kernels=kernels, linear_attention_kernel="torch")
        assert model.elementwise_kernels == kernels
        randomize(model)
        model.zero_grad(set_to_none=True)
        log_probs, _ = model.actor_forward(packed)
        values = model.critic_forward(packed)
        weights = torch.linspace(0.5, 1.5, log_probs.numel(), device="cuda")
        (-(log_probs * weights).mean() + values.pow(2).mean()).backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        runs[kernels] = (log_probs.detach(), values.detach(), grads)
    (lp0, v0, g0), (lp1, v1, g1) = runs["torch"], runs["liger"]
    errors = {"log_probs": _rel(lp1, lp0), "values": _rel(v1, v0)}
    assert sorted(g0) == sorted(g1) and g0
    names = sorted(g0)
    errors["grads"] = _rel(torch.cat([g1[n].flatten() for n in names]), torch.cat([g0[n].flatten() for n in names]))
    errors["worst tensor"] = max(_rel(g1[n], g0[n]) for n in names)
    print(f"model {base_name} {policy}: liger against torch {errors}")
    assert errors["log_probs"] < 2e-2 and errors["values"] < 2e-2 and errors["grads"] < 3e-2, errors
