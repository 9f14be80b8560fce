"""What the in-process engine needs of the trainer (``rollout/engine_checks.py``): it does not start
with CUDA graphs beside an accelerator that frees cuBLAS's workspaces (Lightning's own CUDA
accelerator), and says what to use instead; every other pairing starts."""

from __future__ import annotations

import pytest
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from omegaconf import OmegaConf

from atlas_lightning.config import ConfigError
from atlas_lightning.rollout.engine_checks import accelerator_refusal
from atlas_lightning.run.accelerator import InProcessEngineCUDA

GRAPHS_IN_PROCESS = dict(engine="vllm", enforce_eager=False)


def _cfg(**rollout):
    return OmegaConf.create({"rollout": {**GRAPHS_IN_PROCESS, **rollout}})


def test_lightnings_cuda_accelerator_is_refused_with_what_to_use_instead():
    message = accelerator_refusal(_cfg(), CUDAAccelerator())
    assert message.startswith("rollout.engine=vllm with CUDA graphs (rollout.enforce_eager=false) beside the "
                              "trainer's CUDAAccelerator")
    assert "free cuBLAS's workspaces" in message and "illegal memory access" in message
    assert "accelerator=atlas_lightning.run.accelerator.InProcessEngineCUDA()" in message
    assert "rollout.enforce_eager=true" in message


def test_a_subclass_that_still_frees_them_is_refused_too():
    """Recognised by what it declares, not by being a subclass of Lightning's."""
    class Custom(CUDAAccelerator):
        pass

    assert "trainer's Custom" in accelerator_refusal(_cfg(), Custom())


@pytest.mark.parametrize("accelerator, rollout", [
    (InProcessEngineCUDA(), {}),  # what fit builds
    (CUDAAccelerator(), {"enforce_eager": True}),  # no graphs captured: a freed workspace is made anew
    (CUDAAccelerator(), {"engine": "vllm-server"}),  # the engine in its own process
    (CPUAccelerator(), {}),  # the CPU engine captures no CUDA graphs
    (None, {}),  # no trainer (a datamodule driven by hand)
], ids=["fit's", "eager", "server", "cpu", "no-trainer"])
def test_every_other_pairing_starts(accelerator, rollout):
    assert accelerator_refusal(_cfg(**rollout), accelerator) is None


def test_the_datamodule_refuses_before_the_engine_is_built(cfg_of, monkeypatch):
    """Through ``RolloutDataModule.setup`` as Lightning calls it, in a trainer on Lightning's CUDA
    accelerator: a ``ConfigError`` (the CLI's exit 2), and no engine started."""
    from atlas_lightning.rollout import factory
    from atlas_lightning.rollout.datamodule import RolloutDataModule

    built = []
    monkeypatch.setattr(factory, "build_engine", lambda *args, **kwargs: built.append(args))

    class Trainer:
        global_rank = local_rank = 0
        world_size = 1
        accelerator = CUDAAccelerator()

    dm = RolloutDataModule(cfg_of("rollout.engine=vllm", "rollout.enforce_eager=false"))
    dm.trainer = Trainer()
    with pytest.raises(ConfigError, match=r"beside the trainer's CUDAAccelerator"):
        dm.setup("fit")
    assert built == [] and dm.engine is None
    Trainer.accelerator = InProcessEngineCUDA()
    dm.setup("fit")
    assert len(built) == 1
