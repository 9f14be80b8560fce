"""``run/accelerator.py``: beside an in-process engine on GPUs, Lightning's CUDA set-up and teardown
return the cached memory but leave cuBLAS's workspaces alone (a captured CUDA graph of the engine
keeps their addresses); every other run keeps Lightning's accelerator as configured."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.accelerators import CUDAAccelerator

from atlas_lightning.config import compose
from atlas_lightning.run import environment
from atlas_lightning.run.accelerator import InProcessEngineCUDA, build_accelerator


@pytest.fixture
def calls(monkeypatch):
    """What the set-up and teardown ask of torch and Lightning, recorded instead of run."""
    made = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: made.append("clear workspaces"),
                        raising=False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: made.append("empty cache"))
    monkeypatch.setattr(CUDAAccelerator, "set_nvidia_flags", staticmethod(lambda rank: made.append(f"flags {rank}")))
    return made


def test_the_engine_safe_setup_keeps_the_workspaces_and_returns_the_cache(calls):
    class Trainer:
        local_rank = 3

    InProcessEngineCUDA().setup(Trainer())
    InProcessEngineCUDA().teardown()
    assert calls == ["flags 3", "empty cache", "empty cache"]


def test_lightnings_own_setup_frees_the_workspaces(calls):
    """What the subclass leaves out, seen in Lightning's own: it would free them (so the
    recorded calls above are a difference, not a coincidence of this Lightning version)."""
    class Trainer:
        local_rank = 0

    CUDAAccelerator().setup(Trainer())
    assert calls == ["flags 0", "clear workspaces", "empty cache"]


@pytest.mark.parametrize("overrides, on_gpu, expected", [
    (["trainer.accelerator=gpu", "rollout.engine=vllm"], True, InProcessEngineCUDA),
    (["trainer.accelerator=auto", "rollout.engine=vllm"], True, InProcessEngineCUDA),
    (["trainer.accelerator=gpu", "rollout.engine=vllm-server"], True, "gpu"),  # another process
    (["trainer.accelerator=cpu", "rollout.engine=vllm"], False, "cpu"),
    (["trainer.accelerator=auto", "rollout.engine=vllm"], False, "auto"),  # no CUDA here: Lightning's CPU
])
def test_the_accelerator_is_lightnings_but_beside_an_in_process_engine_on_gpus(monkeypatch, tmp_path, overrides,
                                                                               on_gpu, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: on_gpu)
    cfg = compose(["experiment=tiny-cpu", f"paths.root={tmp_path}", *overrides])
    assert environment.trains_on_gpu(str(cfg.trainer.accelerator)) == on_gpu
    chosen = build_accelerator(cfg)
    assert isinstance(chosen, expected) if isinstance(expected, type) else chosen == expected


def test_what_fit_builds_beside_an_in_process_engine_is_what_the_engine_accepts(monkeypatch, tmp_path):
    """The accelerator chosen for a GPU run with the in-process engine and CUDA graphs passes the
    engine's own check (``rollout/engine_checks.py``); Lightning's in its place would not."""
    from atlas_lightning.rollout.engine_checks import accelerator_refusal

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = compose(["experiment=tiny-cpu", f"paths.root={tmp_path}", "trainer.accelerator=gpu", "rollout.engine=vllm",
                   "rollout.enforce_eager=false"])
    assert accelerator_refusal(cfg, build_accelerator(cfg)) is None
    assert accelerator_refusal(cfg, CUDAAccelerator()) is not None
