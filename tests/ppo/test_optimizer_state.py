"""``optimizer_state.allocate``: the state made before the first update is the state the
optimizer's own first step makes, and moves no parameter; torch's lazily made state is the reference."""

from __future__ import annotations

import pytest
import torch

from atlas_lightning.ppo import optimizer_state


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g))]


def _grads(params, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1),  # decay through the gradient: must be off
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
], ids=["adamw", "amsgrad", "adam-l2", "adamw-loop"])
def test_the_allocated_state_is_the_first_step_s_and_moves_no_parameter(make):
    eager, lazy = _params(0), _params(0)
    eager_opt, lazy_opt = make(eager), make(lazy)
    optimizer_state.allocate(eager_opt)
    assert all(torch.equal(a, b) for a, b in zip(eager, lazy))  # no parameter moved
    assert all(p.grad is None for p in eager)
    for p in eager:
        state = eager_opt.state[p]
        assert float(state["step"]) == 0.0
        assert all(not torch.any(v) for k, v in state.items() if k != "step")
    assert eager_opt.param_groups[0]["lr"] == lazy_opt.param_groups[0]["lr"]
    assert eager_opt.param_groups[0]["weight_decay"] == lazy_opt.param_groups[0]["weight_decay"]
    for step in range(3):
        for params, opt in ((eager, eager_opt), (lazy, lazy_opt)):
            _grads(params, step)
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(eager, lazy))
    for a, b in zip(eager, lazy):
        sa, sb = eager_opt.state[a], lazy_opt.state[b]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert sa[key].dtype == sb[key].dtype and sa[key].device == sb[key].device, key
            assert torch.equal(sa[key], sb[key]), key


def test_state_that_exists_is_left_as_it_is():
    params = _params(1)
    opt = torch.optim.AdamW(params, lr=1e-2)
    _grads(params, 0)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[params[0]].items()}
    optimizer_state.allocate(opt)
    assert all(torch.equal(before[k], v) for k, v in opt.state[params[0]].items())
    assert params[0].grad is not None  # a gradient the caller holds is not touched
