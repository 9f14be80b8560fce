"""A bf16 engine holds the adapter in bf16 (vLLM casts a loaded adapter to the model's dtype),
while the trainer's LoRA masters are fp32: the sync's checksum must compare like with like.
The trainer rounds its factors to the model dtype before summing (``lora_checksum(dtype=)``);
before that, every sync of a bf16 run (every GPU run) was refused as a checksum mismatch.

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

_SCRIPT = """
import json, sys
import torch
from atlas_lightning.config import compose
from atlas_lightning.ppo.module import PPOModule
from atlas_lightning.models.build import build_actor_critic
from atlas_lightning.rollout.engine import AdapterVersion
from atlas_lightning.rollout.engines.vllm_engine import VLLMEngine, lora_checksum
from atlas_lightning.models.weights import adapter_state

model_dir, root = sys.argv[1:3]
cfg = compose(["experiment=tiny-cpu", f"model.path={model_dir}", f"paths.root={root}", "model.dtype=bfloat16"])
module = PPOModule(cfg)
module.model = build_actor_critic(cfg.model, seed=0)
generator = torch.Generator().manual_seed(3)
with torch.no_grad():
    for param in module.model.actor_parameters():
        param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
folder = f"{root}/adapter"
expected = module.export_actor_adapter(folder)
state = adapter_state(module.model, "actor")
pairs = [(t, state[n.replace("lora_A", "lora_B")], 2.0) for n, t in state.items() if ".lora_A." in n]
unrounded = lora_checksum(pairs)
engine = VLLMEngine(model_dir, dtype="bfloat16", max_model_len=1024, lora_rank=8, enforce_eager=True, seed=0)
report = engine.set_adapter(AdapterVersion(folder, version=1))
probe = [(37 * i) % 1900 + 20 for i in range(300)]
gap = max(abs(a - b) for a, b in zip(engine.prompt_logprobs(probe), module.probe_logprobs(probe)))
print("RESULT", json.dumps({"expected": expected, "unrounded": unrounded, "held": [report.tensor_count, report.checksum],
                            "masters": str(next(iter(module.model.actor_parameters())).dtype), "gap": gap}))
"""


def test_the_trainers_checksum_matches_what_a_bf16_engine_holds(tiny_model_dir, tmp_path):
    result = subprocess.run([sys.executable, "-c", _SCRIPT, str(tiny_model_dir), str(tmp_path)], capture_output=True,
                            text=True, timeout=600, env=dict(os.environ))
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stderr[-4000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["masters"] == "torch.float32"
    count, checksum = out["held"]
    assert count == out["expected"][0] > 0
    assert checksum == pytest.approx(out["expected"][1], rel=1e-9)
    # the fp32 masters' own sums differ from what the engine holds: the defect this guards against
    assert out["unrounded"][1] != pytest.approx(checksum, rel=1e-6)
    # the same weights on both sides, bf16: the probe's gap is rounding, within the GPU threshold
    gpu = compose(["experiment=h200-tiny"]).rollout.max_logprob_gap
    print(f"bf16 probe gap, same weights: {out['gap']:.4f} (threshold on GPUs {gpu})")
    assert 0 < out["gap"] < gpu
