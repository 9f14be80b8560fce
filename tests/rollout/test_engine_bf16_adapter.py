"""A bf16 engine holds the adapter in bf16 (vLLM casts a loaded adapter to the model's dtype),
while the trainer's LoRA masters are fp32: the sync's digest must compare like with like. The
engine reports the dtype it holds (``SyncReport.form``) and the trainer digests what it sent in
that form (``rollout.digest.lora_digest(dtype=, scale_b=)``); compared as written, every sync
of a bf16 run (every GPU run) would be refused.

The same setting shows why GPU runs need a looser log-prob gap than fp32 CPU runs: with the same
weights on both sides, bf16 rounding alone moved the probe by 0.098 here (0.06-0.11 on the H200),
over the 0.05 every GPU run was configured with."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from atlas_lightning.config import compose

pytestmark = pytest.mark.vllm

#: One child process, one bf16 engine, both checks (a second engine would cost another start):
#: first the checksum of a sent adapter, then the starting check (clean, then an engine that
#: ignores the adapter). A child because the engine is bf16 beside the suite's fp32 one.
_SCRIPT = """
import json, sys
from types import SimpleNamespace
import torch
from atlas_lightning.config import compose
from atlas_lightning.rollout.sync import export_actor_adapter
from atlas_lightning.models.build import build_actor_critic
from atlas_lightning.models.probe import probe_logprobs
from atlas_lightning.ppo.module import PPOModule
from atlas_lightning.rollout.digest import dtype_named, lora_digest
from atlas_lightning.rollout.engine import AdapterVersion
from atlas_lightning.rollout.engines.args import EngineArgs
from atlas_lightning.rollout.engines.vllm_engine import VLLMEngine
from atlas_lightning.rollout.sync_probe import StartingCheckError
from tests.rollout.test_sync_applied import _ignoring_class

model_dir, root = sys.argv[1:3]
bf16 = ["experiment=tiny-cpu", f"model.path={model_dir}", f"paths.root={root}", "model.dtype=bfloat16",
        "rollout.max_logprob_gap=0.3",
        "rollout.max_model_len=1024", "rollout.max_prompt_length=512", "rollout.max_response_length=512",
        "rollout.max_tokens_per_turn=128"]
cfg = compose(bf16)
engine = VLLMEngine(EngineArgs.from_config(cfg))
probe = [(37 * i) % 1900 + 20 for i in range(300)]

# the checksum: what the engine holds against what the trainer sent
model = build_actor_critic(cfg.model, seed=0)
generator = torch.Generator().manual_seed(3)
with torch.no_grad():
    for param in model.actor_parameters():
        param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
folder = f"{root}/adapter"
sent = export_actor_adapter(model, folder)
report = engine.set_adapter(AdapterVersion(folder, version=1))
form = report.form
expected = lora_digest(sent, dtype=dtype_named(form["dtype"]), scale_b=bool(form.get("scale_b")))
as_written = lora_digest(sent)
gap = max(abs(a - b) for a, b in zip(engine.prompt_logprobs(probe), probe_logprobs(model, probe, torch.device("cpu"))))
checksum = {"held_dtype": form["dtype"], "count": report.tensor_count, "expected_count": len(expected),
            "held_equal": report.digest.total == expected.total, "written_equal": report.digest.total == as_written.total,
            "masters": str(next(iter(model.actor_parameters())).dtype), "gap": gap}

# the starting check, from the base again: a clean engine, then one that holds the adapter and applies none
engine.set_adapter(None)
cfg = compose(bf16 + ["rollout.max_logprob_gap=0.3"])
serving = SimpleNamespace(engine=engine, probe_token_ids=lambda: probe, weights_version=None)


def starting_sync():
    module = PPOModule(cfg)
    module.configure_model()
    module.weight_sync.sync(module.model, serving, version=0)
    return module.weight_sync.movement


moved = starting_sync().last
starting = {"noise": moved.noise, "movement_noises": moved.expected / moved.noise, "ratio": moved.ratio}
engine.set_adapter(None)
engine.__class__ = _ignoring_class()  # holds the adapter, applies none
try:
    starting_sync()
    starting["refused"] = ""
except StartingCheckError as err:
    starting["refused"] = str(err)
print("RESULT", json.dumps({"checksum": checksum, "starting": starting}))
"""


@pytest.fixture(scope="module")
def bf16_engine_results(tiny_model_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("bf16")
    result = subprocess.run([sys.executable, "-c", _SCRIPT, str(tiny_model_dir), str(root)], capture_output=True,
                            text=True, timeout=600, env=dict(os.environ))
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_the_trainers_checksum_matches_what_a_bf16_engine_holds(bf16_engine_results):
    out = bf16_engine_results["checksum"]
    assert out["masters"] == "torch.float32" and "bfloat16" in out["held_dtype"]
    assert out["count"] == out["expected_count"] > 0
    assert out["held_equal"]  # what the engine holds is exactly what was sent, in its form
    # the fp32 masters as written differ from what the engine holds: the defect this guards against
    assert not out["written_equal"]
    # the same weights on both sides, bf16: the probe's gap is rounding, within the GPU threshold
    gpu = compose(["experiment=h200-tiny"]).rollout.max_logprob_gap
    print(f"bf16 probe gap, same weights: {out['gap']:.4f} (threshold on GPUs {gpu})")
    assert 0 < out["gap"] < gpu


def test_the_starting_check_on_a_bf16_engine(bf16_engine_results):
    """bf16 on both sides, as on every card: the engine's noise is four orders above fp32's, and
    the marked adapter must still move the probe measurably. A clean engine passes the starting
    check below the limit; one that holds the adapter and applies none is refused."""
    from atlas_lightning.rollout.sync_probe import MEASURABLE, RESIDUAL_LIMIT

    out = bf16_engine_results["starting"]
    print(f"bf16 starting check: noise {out['noise']:.3g}, movement {out['movement_noises']:.3g} noises, residual "
          f"ratio {out['ratio']:.3g} (limit {RESIDUAL_LIMIT}); ignored adapter: {out['refused'][:160]}")
    assert out["movement_noises"] >= MEASURABLE and out["ratio"] < RESIDUAL_LIMIT / 2
    assert "starting check" in out["refused"] and "refusing to train" in out["refused"]
