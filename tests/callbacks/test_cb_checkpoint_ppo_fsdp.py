"""The PPO module itself under FSDP2 at two ranks (gloo), checkpointed at every step in the
background: each folder verifies against its marker, its Lightning state is whole (both AdamW
optimizers' moments, the loops, the data cursor, each rank's generator states:
``run/resume_state.py``), its adapters are PEFT folders of the module's two adapters, and a run
resumes from it, training with LoRA dropout the step the uninterrupted run trained."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from atlas_lightning.ppo.rng_state import RNG_KEY
from atlas_lightning.run.resume_state import check_resume_state
from atlas_lightning.store.checkpoints import MARKER, verify_checkpoint

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("ppo_checkpoint_worker.py")
FORKED_RANKS = Path(__file__).resolve().parents[1] / "forked_ranks.py"


def _run(model: Path, root: Path, *extra: str) -> dict:
    done = subprocess.run([sys.executable, str(FORKED_RANKS), "2", str(WORKER), str(model), str(root), *extra],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((root / "result.json").read_text())


@pytest.mark.e2e  # two ranks, three checkpointed steps and a resume (~65 s on two cores): make test-e2e; make
# test keeps the background save killed in flight under FSDP2 (test_cb_checkpoint_background.py)
def test_ppo_module_checkpoints_written_in_the_background_verify_and_resume(tiny_model_dir, tmp_path):
    assert _run(tiny_model_dir, tmp_path) == {"resumed_from": None, "rl_step": 3}
    checkpoints = tmp_path / "checkpoints" / "ppo"
    for step in (1, 2, 3):
        folder = checkpoints / f"global_step_{step}"
        files = verify_checkpoint(folder)["files"]
        assert {"actor/lora_adapter/adapter_model.safetensors", "critic/lora_adapter/value_head.safetensors",
                "lightning/.metadata", "lightning/meta.pt"} <= set(files)
        check_resume_state(folder)
    assert not list(checkpoints.glob(".tmp-*"))

    meta = torch.load(checkpoints / "global_step_3" / "lightning" / "meta.pt", weights_only=True)
    assert meta[RNG_KEY]["world_size"] == 2 and len(meta[RNG_KEY]["ranks"]) == 2
    straight = _adapters(checkpoints / "global_step_3")

    (checkpoints / "global_step_3" / MARKER).unlink()  # as if killed before step 3's marker
    assert _run(tiny_model_dir, tmp_path, "resume") == {"resumed_from": "global_step_2", "rl_step": 3}
    verify_checkpoint(checkpoints / "global_step_3")
    resumed = _adapters(checkpoints / "global_step_3")  # every rank's dropout draws continued exactly
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)


def _adapters(step_dir: Path) -> dict:
    from safetensors.torch import load_file

    return {f"{path.parent.parent.name}/{path.name}/{key}": value
            for path in sorted(step_dir.glob("*/lora_adapter/*.safetensors")) for key, value in load_file(path).items()}
